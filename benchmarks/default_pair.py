"""What the default-pair benchmarks share: the --model/--draft/--k/--dtype/--device/--out flags, the
pair they resolve to (the embedded SmolLM2-135M-Instruct and the package's default draft unless given),
and each run's rows written as JSON under benchmarks/results/."""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from benchmark_spec_decode import positive_int

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFT = REPO / "vllm_spec" / "assets" / "default_draft"


def add_pair_args(p: argparse.ArgumentParser, name: str) -> None:
    """The shared flags; `name` names the default JSON file."""
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft model, or 'none' (default: the package's default draft "
                                                 "with the default model, else none)")
    p.add_argument("--k", type=positive_int, default=4, help="speculative tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None, help=f"JSON path (default: benchmarks/results/{name}_<time>.json)")


def resolve_pair(args: argparse.Namespace) -> tuple[str, str]:
    """(target, draft): the draft is 'none' for a target given without one."""
    model = args.model
    if model is None:
        from vllm_spec.model.default_model import default_model_path
        model = str(default_model_path())
    draft = args.draft if args.draft is not None else (str(DEFAULT_DRAFT) if args.model is None else "none")
    return model, draft


def write_rows(args: argparse.Namespace, name: str, model: str, draft: str, rows: list) -> Path:
    out = Path(args.out) if args.out else (REPO / "benchmarks" / "results" /
                                           f"{name}_{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "model": model, "draft": draft, "host": platform.node(),
                               "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out}")
    return out
