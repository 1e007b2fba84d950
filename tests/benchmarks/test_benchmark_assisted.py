"""benchmarks/benchmark_assisted.py on tiny random Llama pairs: the HF draft, the acceptance counts, the run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import benchmark_assisted as ba  # noqa: E402

from vllm_spec import LLM  # noqa: E402

K = 2
PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 250, 31, 12, 60, 61, 62, 8, 200, 19, 4, 77, 90, 11, 13, 2, 300]]


def borrowing_draft(src: Path, dest: Path, tied: bool) -> Path:
    """src's checkpoint as a draft that, like the shipped default draft, borrows the target's embeddings."""
    shutil.copytree(src, dest)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(tie_word_embeddings=tied, vllm_spec_embeddings_from_target=True)
    (dest / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k not in ("model.embed_tokens.weight", "lm_head.weight")},
              str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="module")
def target_hf(tiny_llama):
    return ba.load_hf_model(str(tiny_llama), torch.float32)


@pytest.fixture(scope="module")
def self_draft(tiny_llama, tmp_path_factory) -> Path:
    """The target's own layers and head: every draft token is the target's, acceptance 1."""
    return borrowing_draft(tiny_llama, tmp_path_factory.mktemp("d") / "self_draft", tied=False)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_draft_matches_engine_draft(tiny_llama, target_hf, tmp_path, tied):
    # The target is untied, so a tied draft's head (the embedding) differs from an untied one's (the target's head).
    src = make_tiny_model(tmp_path / "src", "llama", seed=5, num_hidden_layers=1)
    draft = borrowing_draft(src, tmp_path / "draft", tied)
    draft_hf = ba.load_hf_draft(draft, target_hf, torch.float32)
    assert draft_hf.config.tie_word_embeddings is tied
    assert torch.equal(draft_hf.model.embed_tokens.weight, target_hf.model.embed_tokens.weight)
    head = target_hf.model.embed_tokens.weight if tied else target_hf.lm_head.weight
    assert torch.equal(draft_hf.lm_head.weight, head)

    llm = LLM(str(tiny_llama), speculative_model=str(draft), num_speculative_tokens=K, max_model_len=128,
              kv_cache_memory_bytes=1 << 22)
    check = ba.check_draft(llm, draft_hf, PROMPTS)
    assert check["positions"] == sum(map(len, PROMPTS))
    assert check["argmax_match"] == 1.0 and check["passed"]
    assert check["max_abs_logit_diff"] < 1e-4


def test_forward_counter_on_a_perfect_draft(target_hf, self_draft):
    draft_hf = ba.load_hf_draft(self_draft, target_hf, torch.float32)
    ba.set_assistant_schedule(draft_hf, K)
    new = 3 * (K + 1)  # three full rounds: K accepted candidates plus the target's token each
    greedy = ba.hf_generate(target_hf, PROMPTS[1], new, pad_id=0)
    with ba.ForwardCounter(target_hf, draft_hf) as counter:
        got = ba.hf_generate(target_hf, PROMPTS[1], new, pad_id=0, assistant=draft_hf)
    assert got == greedy
    assert counter.proposed_per_round == [K, K, K]
    assert counter.stats(len(got)) == ba.SpecStats(proposed=3 * K, accepted=3 * K, steps=3)


def test_main_runs_every_system(tiny_llama, self_draft, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = ba.main(["--gguf", str(tiny_llama), "--draft", str(self_draft), "--num-prompts", "2",
                  "--max-tokens", "6", "--k", str(K), "--max-model-len", "128", "--kv-cache-mb", "4",
                  "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = {(r["system"], r["method"]): r for r in res["rows"]}
    assert list(rows) == [("ours", "plain"), ("ours", "fixed"), ("ours", "adaptive"),
                          ("hf", "greedy"), ("hf", "assisted"), ("hf", "assisted-default")]
    assert res["draft_check"]["argmax_match"] == 1.0
    for r in rows.values():
        assert r["tokens"] == 12 and r["same_as_hf_greedy"] == 1.0
    for key in [("ours", "fixed"), ("hf", "assisted")]:   # the draft is the target: everything is accepted
        assert rows[key]["acceptance_rate"] == 1.0 and rows[key]["mean_accepted_length"] == K + 1
    assert rows[("ours", "plain")]["vs_hf"] == pytest.approx(
        rows[("ours", "plain")]["tokens_per_s"] / rows[("hf", "greedy")]["tokens_per_s"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("| hf | assisted-default |")
