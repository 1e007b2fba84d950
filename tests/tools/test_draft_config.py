"""The config the draft-training script writes (tools/draft_training/common.py) asks the engine for what the
shipped default draft's does: its vllm_spec_* keys are the same, and the engine reads them."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_spec.entrypoints.cli import default_draft_path
from vllm_spec.model.arch_config import ArchConfig

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def test_the_training_script_writes_the_shipped_drafts_engine_keys(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    from draft_training.common import draft_config

    shipped = json.loads((default_draft_path() / "config.json").read_text())
    target = {k: shipped[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                                      "max_position_embeddings", "bos_token_id", "eos_token_id")}
    written = draft_config(target, shipped["num_hidden_layers"])
    engine_keys = {k: v for k, v in shipped.items() if k.startswith("vllm_spec_")}
    assert engine_keys and {k: written.get(k) for k in engine_keys} == engine_keys
    arch = ArchConfig.from_hf_dict(written)
    assert arch.cpu_weights == "q8_0" and arch.embeddings_from_target and len(arch.draft_vocab) == 16384
