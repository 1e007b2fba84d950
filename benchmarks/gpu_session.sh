#!/usr/bin/env bash
# One device call: GPU tests, the speculative-decoding benchmark, optionally the policy benchmark.
# Logs and JSON go to $OUT.
# Usage (on the device machine, repo root): [SKIP_TESTS=1] [POLICY=1] bash benchmarks/gpu_session.sh [spec args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/attn/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/attn/*.whl
    export PYTHONPATH=.:/tmp/site
fi
# Structured outputs need xgrammar (and pydantic), which the device lacks: carry .whl (cp312 wheels).
if ! python3 -c "import xgrammar" 2>/dev/null && ls .whl/structured/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_so .whl/structured/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site_so
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu tests/structured_output 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
python3 benchmarks/benchmark_spec_decode.py --out "$OUT/spec_decode.json" --plot "$OUT/speedup.png" "$@" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^{" | tail -60
if [ "${POLICY:-0}" = 1 ]; then
    python3 benchmarks/benchmark_policy.py --trace --out "$OUT/policy.json" --plot "$OUT/policy.png" \
        2>&1 | tee "$OUT/policy.log" | grep -v "^{" | tail -45
fi
