"""A per-row float64 reference for the sampler's logits processing and a SamplingMetadata builder, for the tests."""

from __future__ import annotations

import math
from collections import Counter

import torch

from vllm_spec.sample.metadata import SamplingMetadata, SamplingRow
from vllm_spec.sampling_params import SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


# A straightforward reference, one row at a time, with vLLM's semantics. ------------------------------

def reference_logits(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The logits a row samples from (greedy: takes the argmax of), computed in float64.

    Order as in vLLM: allowed_token_ids (-inf elsewhere), logit_bias (added), repetition penalty
    (prompt + output tokens: positive logits divided, others
    multiplied), frequency penalty (x count in output), presence penalty (output tokens), min_tokens
    (stop/EOS ids banned), bad words (a word's last token banned where the output ends with the rest), then for random rows: temperature, top-k, top-p (on the top-k
    renormalised distribution: keep the smallest prefix reaching top_p), min-p (relative to the max).
    """
    x = [float(v) for v in logits]
    V = len(x)
    if p.allowed_token_ids is not None:
        x = [v if i in p.allowed_token_ids else NEG_INF for i, v in enumerate(x)]
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = Counter(output)
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c
        x[t] -= p.presence_penalty
    if len(output) < p.min_tokens:
        for t in p.all_stop_token_ids:
            x[t] = NEG_INF
    for word in p.bad_words_token_ids:   # banned where the output ends with the word's other tokens
        if len(word) - 1 <= len(output) and (len(word) == 1 or output[-(len(word) - 1):] == word[:-1]):
            x[word[-1]] = NEG_INF
    if p.temperature < 1e-5:
        return torch.tensor(x, dtype=torch.float64)
    x = [v / p.temperature for v in x]
    order = sorted(range(V), key=lambda i: -x[i])
    keep = set(order)
    if p.top_k > 0:
        keep = set(order[: p.top_k])
    if p.top_p < 1.0:
        z = [math.exp(x[i]) if i in keep and x[i] > NEG_INF else 0.0 for i in range(V)]
        total = sum(z)
        mass, nucleus = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            if mass >= p.top_p:
                break
            nucleus.add(i)
            mass += z[i] / total
        keep = nucleus
    if p.min_p > 0.0:
        z = {i: math.exp(x[i]) for i in keep if x[i] > NEG_INF}
        top = max(z.values())
        keep = {i for i in z if z[i] >= p.min_p * top}
    return torch.tensor([x[i] if i in keep else NEG_INF for i in range(V)], dtype=torch.float64)


def build(params: list[SamplingParams], prompts=None, outputs=None, gens=None, vocab: int = 32) -> SamplingMetadata:
    n = len(params)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    gens = gens or [None] * n
    rows = [SamplingRow(p, pr, o, g) for p, pr, o, g in zip(params, prompts, outputs, gens)]
    return SamplingMetadata.build(rows, vocab, CPU)
