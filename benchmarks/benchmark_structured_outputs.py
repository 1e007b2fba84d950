"""Structured outputs with and without speculation, in the same run.

Chat requests asking for JSON, generated greedily (a) unconstrained and (b) under a JSON schema
(structured outputs), by plain decoding, the draft model and n-gram speculation. Per system and
constraint: generated tokens/s, the speedup over plain decoding under the same constraint, the
acceptance rate, the share of outputs that are valid JSON matching the schema's required keys, and
whether the token ids equal plain decoding's (they must: speculation is lossless under a grammar).

    python benchmarks/benchmark_structured_outputs.py                 # default pair, CPU or GPU
    python benchmarks/benchmark_structured_outputs.py --model M --draft D --batch 8 --max-tokens 128

A table is printed and JSON is written under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_spec_decode import positive_int
from default_pair import add_pair_args, resolve_pair, write_rows

from vllm_spec import LLM, SamplingParams
from vllm_spec.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"]}
PEOPLE = ["a retired sailor", "a young painter", "a chess champion", "a village baker", "a space engineer",
          "a jazz drummer", "a mountain guide", "a librarian"]


@dataclass
class Row:
    system: str
    constraint: str
    requests: int
    seconds: float
    tokens_per_s: float
    acceptance_rate: float | None
    valid_json: float
    speedup: float | None = None
    identical_to_plain: bool | None = None


def _metric(llm: LLM, name: str) -> float:
    return next((m.value for m in llm.get_metrics() if m.name == name), 0.0)


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and all(k in value for k in SCHEMA["required"])


def run(system: str, constraint: str, model: str, spec: dict, args) -> tuple[Row, list[list[int]]]:
    llm = LLM(model, dtype=args.dtype, device=args.device, seed=0, **spec)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constraint == "json_schema" else None
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
    messages = [[{"role": "user", "content": f"Describe {PEOPLE[i % len(PEOPLE)]} as a JSON object with the keys "
                                             "name, age, city and hobbies."}] for i in range(args.requests)]
    llm.chat(messages[:1], params, use_tqdm=False)   # warm-up (and the grammar's compilation)
    drafted, accepted = (_metric(llm, f"vllm:spec_decode_num_{n}_tokens") for n in ("draft", "accepted"))
    start = time.perf_counter()
    outs = []
    for i in range(0, len(messages), args.batch):
        outs += llm.chat(messages[i:i + args.batch], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    drafted = _metric(llm, "vllm:spec_decode_num_draft_tokens") - drafted
    accepted = _metric(llm, "vllm:spec_decode_num_accepted_tokens") - accepted
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row = Row(system, constraint, len(outs), seconds, tokens / seconds, accepted / drafted if drafted else None,
              sum(_valid(o.outputs[0].text) for o in outs) / len(outs))
    return row, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> list[Row]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_args(p, "structured_outputs")
    p.add_argument("--requests", type=positive_int, default=8)
    p.add_argument("--batch", type=positive_int, default=1, help="requests per generate call")
    p.add_argument("--max-tokens", type=positive_int, default=96)
    p.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"])
    args = p.parse_args(argv)
    model, draft = resolve_pair(args)
    systems = {"plain": {}}
    if draft != "none":
        systems["draft"] = dict(speculative_model=draft, num_speculative_tokens=args.k,
                                speculative_policy=args.policy)
    systems["ngram"] = dict(speculative_model="[ngram]", num_speculative_tokens=args.k,
                            ngram_prompt_lookup_max=3, speculative_policy=args.policy)
    rows = []
    for constraint in ("none", "json_schema"):
        plain_ids = None
        for system, spec in systems.items():
            row, ids = run(system, constraint, model, spec, args)
            if system == "plain":
                plain_ids, plain_row = ids, row
            else:
                row.identical_to_plain = ids == plain_ids
            row.speedup = row.tokens_per_s / plain_row.tokens_per_s
            rows.append(row)
    print(f"{'system':<7} {'constraint':<11} {'req':>4} {'s':>7} {'tok/s':>7} {'speedup':>7} {'accept':>6} "
          f"{'valid':>5} {'same':>5}")
    for r in rows:
        accept = "" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        same = "" if r.identical_to_plain is None else str(r.identical_to_plain)
        print(f"{r.system:<7} {r.constraint:<11} {r.requests:4d} {r.seconds:7.2f} {r.tokens_per_s:7.1f} "
              f"{r.speedup:7.2f} {accept:>6} {r.valid_json:5.2f} {same:>5}")
    write_rows(args, "structured_outputs", model, draft, rows)
    return rows


if __name__ == "__main__":
    main()
