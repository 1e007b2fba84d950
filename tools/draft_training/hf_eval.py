"""--eval: the shipped draft checked with HF transformers models on CPU (match rate, simulated and real spec decoding)."""

from __future__ import annotations

import json
import time

import torch

from draft_training.common import EMBED_KEY, gguf_path, load_target_weights, log


def hf_models(args):
    import transformers
    from safetensors.torch import load_file
    tcfg, tsd = load_target_weights(gguf_path(args))
    # (pass every key: transformers 5 keeps rope_theta under rope_parameters, not in LlamaConfig().to_dict())
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tcfg))
    target.load_state_dict(tsd, strict=False)
    target.tie_weights()
    target.eval().requires_grad_(False)
    dcfg = json.loads((args.out / "config.json").read_text())
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dcfg))
    for m in (target, draft):
        assert abs(m.model.rotary_emb.inv_freq[1].item() - dcfg["rope_theta"] ** (-2 / dcfg["head_dim"])) < 1e-6
    dsd = {k: v.float() for k, v in load_file(str(args.out / "model.safetensors")).items()}
    dsd[EMBED_KEY] = tsd[EMBED_KEY].clone()  # shared with the target at run time
    missing, unexpected = draft.load_state_dict(dsd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    draft.tie_weights()
    draft.eval().requires_grad_(False)
    eos = tcfg["eos_token_id"] if isinstance(tcfg["eos_token_id"], int) else tcfg["eos_token_id"][0]
    return target, draft, eos


@torch.no_grad()
def hf_greedy(model, prompt: list, n: int, eos: int) -> list:
    from transformers import DynamicCache
    cache, x, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
    while len(out) < n:
        t = int(model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        out.append(t)
        if t == eos:
            break
        x = torch.tensor([[t]])
    return out


def _crop(cache, keep: int):
    """Drop cached positions past ``keep`` (negative crop works on transformers 4 and 5)."""
    n = cache.get_seq_length() - keep
    if n > 0:
        cache.crop(-n)


@torch.no_grad()
def hf_spec(target, draft, prompt: list, n: int, eos: int, k: int):
    """Greedy speculative decoding (batch 1, KV caches): returns (tokens, target forward passes)."""
    from transformers import DynamicCache
    tc, dc = DynamicCache(config=target.config), DynamicCache(config=draft.config)
    target(input_ids=torch.tensor([prompt[:-1]]), past_key_values=tc, use_cache=True)
    draft(input_ids=torch.tensor([prompt[:-1]]), past_key_values=dc, use_cache=True)
    seq, out, steps = list(prompt), [], 0
    while len(out) < n and (not out or out[-1] != eos):
        # the draft's cache covers seq[:-1]; catch up if it is behind (after a fully accepted step)
        if dc.get_seq_length() < len(seq) - 1:
            draft(input_ids=torch.tensor([seq[dc.get_seq_length():len(seq) - 1]]), past_key_values=dc, use_cache=True)
        props, x = [], torch.tensor([[seq[-1]]])
        for _ in range(k):
            t = int(draft(input_ids=x, past_key_values=dc, use_cache=True).logits[0, -1].argmax())
            props.append(t)
            x = torch.tensor([[t]])
        tgt = target(input_ids=torch.tensor([[seq[-1]] + props]), past_key_values=tc,
                     use_cache=True).logits[0].argmax(-1).tolist()
        a = 0
        while a < k and props[a] == tgt[a]:
            a += 1
        new = props[:a] + [tgt[a]]
        if eos in new:
            new = new[:new.index(eos) + 1]
        steps += 1
        seq += new
        out += new
        _crop(tc, len(seq) - 1)
        _crop(dc, len(seq) - 1)
    return out[:n], steps


@torch.no_grad()
def hf_simulate(draft, p: list, o: list, k: int) -> list:
    """Greedy spec-decoding simulation against the target continuation ``o`` with a draft KV cache;
    returns the number of accepted draft tokens at each target step."""
    from transformers import DynamicCache
    cache, j, accepted = DynamicCache(config=draft.config), 0, []
    while j < len(o):
        seq = p + o[:j]
        L = cache.get_seq_length()
        if L < len(seq) - 1:  # bring the cache up to seq[:-1]
            draft(input_ids=torch.tensor([seq[L:len(seq) - 1]]), past_key_values=cache, use_cache=True)
        x, a = seq[-1], 0
        for _ in range(min(k, len(o) - j)):
            t = int(draft(input_ids=torch.tensor([[x]]), past_key_values=cache, use_cache=True,
                          logits_to_keep=1).logits[0, -1].argmax())
            if t != o[j + a]:
                break
            a += 1
            x = t
        accepted.append(a)
        j += a + 1
        _crop(cache, len(p) + j - 1)
    return accepted


def stage_hf_eval(args):
    prep = torch.load(args.prep or args.cache_dir / "prep.pt")
    target, draft, eos = hf_models(args)
    held = prep["heldout"][:args.eval_prompts]
    t0 = time.time()
    evals = []
    for i in range(0, len(held), 10):  # target greedy continuations, left-padded batches of 10
        batch = held[i:i + 10]
        L = max(len(p) for p in batch)
        ids = torch.tensor([[eos] * (L - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.eval_tokens,
                                  do_sample=False, pad_token_id=eos, eos_token_id=eos)
        for row in out[:, L:].tolist():
            evals.append(row[:row.index(eos) + 1] if eos in row else row)
    evals = list(zip(held, evals))
    log(f"target greedy on {len(held)} held-out prompts: {(time.time() - t0):.0f} s")
    n_tok = n_match = 0
    hist = [0] * (args.k + 1)
    with torch.no_grad():
        for p, o in evals:
            pred = draft(input_ids=torch.tensor([p + o[:-1]])).logits[0, len(p) - 1:].argmax(-1)
            n_match += int((pred == torch.tensor(o)).sum())
            n_tok += len(o)
            for a in hf_simulate(draft, p, o, args.k):
                hist[a] += 1
    steps = sum(hist)
    res = {"eval_prompts": len(evals), "eval_tokens": n_tok, "match_rate": round(n_match / n_tok, 4),
           f"mean_accepted_k{args.k}": round(sum(a * c for a, c in enumerate(hist)) / steps, 3),
           f"tokens_per_target_step_k{args.k}": round(n_tok / steps, 3), f"accepted_hist_k{args.k}": hist}
    log("HF eval:", json.dumps(res))
    if args.bench:
        prompts = held[:args.bench_prompts]
        hf_greedy(target, prompts[0], 4, eos)  # warm-up
        tp = ts = 0.0
        ntok = steps = 0
        same = True
        for p in prompts:
            t = time.time()
            a = hf_greedy(target, p, args.bench_tokens, eos)
            tp += time.time() - t
            t = time.time()
            b, s = hf_spec(target, draft, p, args.bench_tokens, eos, args.bench_k)
            ts += time.time() - t
            same &= a == b
            ntok += len(a)
            steps += s
        res.update({"bench_prompts": len(prompts), "bench_tokens": ntok, "bench_k": args.bench_k,
                    "target_only_tok_s": round(ntok / tp, 2), "spec_tok_s": round(ntok / ts, 2),
                    "speedup": round(tp / ts, 3), "spec_target_steps": steps, "outputs_identical": bool(same)})
        log("bench:", json.dumps(res))
    print(json.dumps(res, indent=2))
    return res
