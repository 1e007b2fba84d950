"""The distill stage: teacher data from the target, KL training of draft variants, held-out evaluation, export."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from draft_training.common import EMBED_KEY, gguf_path, load_target_weights, log
from draft_training.llama import Llama, make_draft


@torch.no_grad()
def generate(model: Llama, prompts: list, max_new: int, eos: int, topk: int = 0, dev="cpu"):
    """Greedy decode a left-padded batch; returns [(response ids, topk logprobs [n,K] f16, ids [n,K] i32)]."""
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), eos, dtype=torch.long)
    km = torch.zeros((B, L + max_new), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        km[i, L - len(p):] = True
    ids, km = ids.to(dev), km.to(dev)
    pos = (km[:, :L].long().cumsum(-1) - 1).clamp(min=0)
    cache = model.new_cache(B, L + max_new, dev)
    h = model.hidden(ids, pos, cache, 0, km)[:, -1]
    toks, lps, tis = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    lens = torch.full((B,), max_new, device=dev)
    for step in range(max_new):
        logits = model.logits(h).float()
        nxt = logits.argmax(-1)
        toks.append(nxt)
        if topk:
            t = torch.log_softmax(logits, -1).topk(topk, -1)
            lps.append(t.values.half())
            tis.append(t.indices.int())
        newly = (nxt == eos) & ~done
        lens = torch.where(newly, torch.full_like(lens, step + 1), lens)
        done |= newly
        if step == max_new - 1 or bool(done.all()):
            break
        km[:, L + step] = True
        pos = pos[:, -1:] + 1
        h = model.hidden(nxt[:, None], pos, cache, L + step, km)[:, -1]
    toks = torch.stack(toks, 1).cpu()
    lens = lens.clamp(max=toks.shape[1]).cpu()
    if topk:
        lps, tis = torch.stack(lps, 1).cpu(), torch.stack(tis, 1).cpu()
    out = []
    for i in range(B):
        n = int(lens[i])
        out.append((toks[i, :n].tolist(), lps[i, :n] if topk else None, tis[i, :n] if topk else None))
    return out


def run_gen(args, target, prompts: list, eos: int, dev) -> list:
    """Teacher data (a): records {ids, start, n, lp, ti} for the target's greedy responses."""
    f = args.cache_dir / f"gen_{args.gen_tokens}_{args.gen_max_new}_{args.topk}.pt"
    if f.exists():
        return torch.load(f)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + args.gen_batch] for i in range(0, len(order), args.gen_batch)]
    random.Random(args.seed).shuffle(batches)
    recs, total, t0 = [], 0, time.time()
    for bi, b in enumerate(batches):
        if total >= args.gen_tokens or (time.time() - t0) / 60 > args.gen_minutes:
            break
        res = generate(target, [prompts[i] for i in b], args.gen_max_new, eos, args.topk, dev)
        for i, (o, lp, ti) in zip(b, res):
            recs.append({"ids": torch.tensor(prompts[i] + o, dtype=torch.int32), "start": len(prompts[i]) - 1,
                         "n": len(o), "lp": lp, "ti": ti, "prompt": i})
            total += len(o)
        if bi % 10 == 0:
            log(f"gen batch {bi}/{len(batches)}: {total} response tokens, {(time.time() - t0) / 60:.1f} min")
    log(f"gen: {len(recs)} responses, {total} tokens, {(time.time() - t0) / 60:.1f} min")
    torch.save(recs, f)
    return recs


@torch.no_grad()
def run_text(args, target, chunks: list, dev) -> list:
    """Teacher data (b): top-k target log-probs on plain-text chunks (all positions but the last)."""
    recs = []
    for i in range(0, len(chunks), args.text_batch):
        x = torch.tensor(chunks[i:i + args.text_batch], device=dev)
        lp = torch.log_softmax(target.logits(target.hidden(x)).float(), -1)[:, :-1].topk(args.topk, -1)
        for j in range(x.shape[0]):
            recs.append({"ids": x[j].int().cpu(), "start": 0, "n": x.shape[1] - 1, "lp": lp.values[j].half().cpu(),
                         "ti": lp.indices[j].int().cpu()})
    log(f"text: {len(recs)} chunks, {sum(r['n'] for r in recs)} positions")
    return recs


def kl_loss(draft: Llama, batch: list, dev):
    """Mean KL(target||draft) over the batch's teacher positions (truncated to the target's top-k)."""
    L = max(len(r["ids"]) for r in batch)
    ids = torch.zeros((len(batch), L), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, :len(r["ids"])] = r["ids"].long()
    rows = torch.cat([torch.full((r["n"],), i) for i, r in enumerate(batch)]).to(dev)
    cols = torch.cat([torch.arange(r["start"], r["start"] + r["n"]) for r in batch]).to(dev)
    tlp = torch.cat([r["lp"] for r in batch]).to(dev).float()
    tid = torch.cat([r["ti"] for r in batch]).to(dev).long()
    h = draft.hidden(ids.to(dev))[rows, cols]
    logq = torch.log_softmax(draft.logits(h).float(), -1)
    kl = (tlp.exp() * (tlp - logq.gather(1, tid))).sum(-1)
    return kl.mean(), kl.numel(), int((logq.argmax(-1) == tid[:, 0]).sum())


def make_batches(recs: list, max_tokens: int, rng: random.Random) -> list:
    recs = sorted(recs, key=lambda r: len(r["ids"]) + 3 * rng.random())
    batches, cur, mx = [], [], 0
    for r in recs:
        if cur and (len(cur) + 1) * max(mx, len(r["ids"])) > max_tokens:
            batches.append(cur)
            cur, mx = [], 0
        cur.append(r)
        mx = max(mx, len(r["ids"]))
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def train_variant(args, tcfg, tsd, layers: list, train: list, val: list, dev):
    torch.manual_seed(args.seed)
    draft = make_draft(tcfg, tsd, layers, dev)
    params = [p for p in draft.parameters() if p.requires_grad]

    @torch.no_grad()
    def evaluate():
        draft.eval()
        tot = n = m = 0
        for b in make_batches(val, args.batch_tokens, random.Random(0)):
            l, k, mm = kl_loss(draft, b, dev)
            tot, n, m = tot + float(l) * k, n + k, m + mm
        draft.train()
        return tot / n, m / n

    vl0, vm0 = evaluate()
    log(f"variant {layers}: {sum(p.numel() for p in params) / 1e6:.2f} M trainable; "
        f"init val KL {vl0:.3f} match {vm0:.3f}")
    epochs = [make_batches(train, args.batch_tokens, random.Random(args.seed + e))
              for e in range(math.ceil(args.epochs))]
    total = int(sum(len(b) for b in epochs[:int(args.epochs)]) + (args.epochs % 1) * len(epochs[-1]))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, min(50, total // 20))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, total))))))
    step, t0, hist = 0, time.time(), []
    rl = rm = rn = 0
    for e, batches in enumerate(epochs):
        for b in batches:
            if step >= total or (time.time() - t0) / 60 > args.train_minutes:
                break
            loss, k, m = kl_loss(draft, b, dev)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            rl, rm, rn = rl + float(loss.detach()) * k, rm + m, rn + k
            if step % args.log_every == 0 or step == total:
                vl, vm = evaluate()
                hist.append({"step": step, "train_kl": round(rl / rn, 4), "train_match": round(rm / rn, 4),
                             "val_kl": round(vl, 4), "val_match": round(vm, 4)})
                log(f"  {layers} step {step}/{total} ep {e}: train KL {rl / rn:.3f} match {rm / rn:.3f} | "
                    f"val KL {vl:.3f} match {vm:.3f} | {(time.time() - t0) / 60:.1f} min")
                rl = rm = rn = 0
    vl, vm = evaluate()
    return draft, {"layers": layers, "steps": step, "val_kl_init": round(vl0, 4), "val_match_init": round(vm0, 4),
                   "val_kl": round(vl, 4), "val_match": round(vm, 4),
                   "train_minutes": round((time.time() - t0) / 60, 2),
                   "history": hist}


@torch.no_grad()
def eval_draft(draft, evals: list, k: int, dev, greedy_fn=None, simulate: bool = True) -> dict:
    """evals: [(prompt ids, target greedy continuation)] -> match rate and simulated k-step acceptance.
    ``greedy_fn(model, ids_list) -> argmax ids [T]`` defaults to our Llama; the HF path passes its own."""
    if greedy_fn is None:
        def greedy_fn(seq, last=False):
            h = draft.hidden(torch.tensor([seq], device=dev))[0]
            return draft.logits(h[-1:] if last else h).argmax(-1).cpu()
    n_tok = n_match = steps = acc = 0
    hist = [0] * (k + 1)
    for p, o in evals:
        if not o:
            continue
        full = p + o
        pred = greedy_fn(full[:-1])[len(p) - 1:]
        n_match += int((pred == torch.tensor(o)).sum())
        n_tok += len(o)
        j = 0
        while simulate and j < len(o):
            kk = min(k, len(o) - j)
            seq, a = p + o[:j], 0
            for _ in range(kk):  # draft proposes autoregressively; stop at first mismatch (rest is rejected)
                t = int(greedy_fn(seq, last=True)[-1])
                if t != o[j + a]:
                    break
                seq = seq + [t]
                a += 1
            steps += 1
            acc += a
            hist[a] += 1
            j += a + 1
    if not simulate:
        return {"eval_prompts": len(evals), "eval_tokens": n_tok, "match_rate": round(n_match / n_tok, 4)}
    return {"eval_prompts": len(evals), "eval_tokens": n_tok, "match_rate": round(n_match / n_tok, 4),
            f"mean_accepted_k{k}": round(acc / steps, 3), f"tokens_per_target_step_k{k}": round(n_tok / steps, 3),
            f"accepted_hist_k{k}": hist}


def export(draft: Llama, out: Path, extra: dict):
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().to(torch.float16).contiguous() for k, v in draft.state_dict().items() if k != EMBED_KEY}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(draft.c, indent=2) + "\n")
    (out / "train_stats.json").write_text(json.dumps(extra, indent=2) + "\n")
    log(f"exported {len(sd)} tensors ({sum(v.numel() for v in sd.values()) / 1e6:.2f} M params) to {out}")


def stage_distill(args):
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # teacher numerics close to the fp32 CPU engine
        torch.backends.cudnn.allow_tf32 = False
    t_start = time.time()
    prep = torch.load(args.prep or args.cache_dir / "prep.pt")
    if args.smoke:  # code-path check on a random 4-layer target (no GGUF needed)
        tcfg = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 4,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}
        tsd = Llama(tcfg).state_dict()
    else:
        tcfg, tsd = load_target_weights(gguf_path(args))
    tcfg_full = {**tcfg}
    target = Llama(tcfg_full)
    target.load_state_dict(tsd, strict=True)
    target.to(dev).eval().requires_grad_(False)
    eos = tcfg["eos_token_id"] if isinstance(tcfg["eos_token_id"], int) else tcfg["eos_token_id"][0]
    log(f"target loaded on {dev} ({(time.time() - t_start):.0f} s)")

    # held-out eval targets first (cheap), then teacher data
    def continuations(prompts: list) -> list:
        out = []
        for i in range(0, len(prompts), 64):
            res = generate(target, prompts[i:i + 64], args.eval_tokens, eos, 0, dev)
            out += [(p, o) for p, (o, _, _) in zip(prompts[i:i + 64], res)]
        return out

    evals = continuations(prep["heldout"][:args.eval_prompts])
    bench_evals = continuations(prep.get("bench", []))
    chat = run_gen(args, target, prep["train"], eos, dev)
    text = run_text(args, target, prep["text"][:args.text_chunks], dev) if args.text_chunks else []
    t_data = time.time() - t_start
    rng = random.Random(args.seed)
    rng.shuffle(chat)
    nval = max(8, len(chat) // 50)
    val, chat = chat[:nval], chat[nval:]
    train = chat + text
    log(f"data: {len(chat)} chat seqs ({sum(r['n'] for r in chat)} tok), {len(text)} text seqs "
        f"({sum(r['n'] for r in text)} tok), val {len(val)} seqs ({sum(r['n'] for r in val)} tok); "
        f"{t_data / 60:.1f} min")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # teacher data is done; TF32 is fine for training
    tsd_cpu = {k: v for k, v in tsd.items()}
    del tsd
    best = None
    results = []
    for spec in args.variants.split(";"):
        layers = [int(x) for x in spec.split(",")]
        draft, st = train_variant(args, tcfg, tsd_cpu, layers, train, val, dev)
        st["heldout"] = eval_draft(draft, evals[:args.variant_eval_prompts], args.k, dev, simulate=False)
        log(f"variant {layers}: val KL {st['val_kl']} match {st['val_match']}; held-out {st['heldout']}")
        results.append(st)
        if best is None or st["val_kl"] < best[1]["val_kl"]:
            best = (draft, st)
    draft, st = best
    final = eval_draft(draft, evals, args.k, dev)
    log(f"chosen {st['layers']}: held-out ({len(evals)} prompts) {final}")
    bench = eval_draft(draft, bench_evals, args.k, dev) if bench_evals else None
    log(f"benchmarks/prompts.py (chat, then raw; never trained on): {bench}")
    stats = {"chosen_layers": st["layers"], "heldout_eval": final, "bench_prompts_eval": bench, "variants": results,
             "data": {"chat_seqs": len(chat), "chat_tokens": sum(r["n"] for r in chat), "text_seqs": len(text),
                      "text_tokens": sum(r["n"] for r in text), "val_seqs": len(val),
                      "val_tokens": sum(r["n"] for r in val), "data_minutes": round(t_data / 60, 2)},
             "args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
             "device": str(dev) + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""),
             "wall_minutes": round((time.time() - t_start) / 60, 2)}
    export(draft, args.out, stats)
