"""End to end: what the speculation policy measures and learns from the running engine: the adaptive
policy's cost measurements and exploration, verification and step times (host, caller and idle time
told apart), every step's lesson once and in order, the chosen-k metric, failures to learn that leave
the steps running, and drafts the proposer did not find. Policies and catch-up: test_policy_e2e.py."""

from __future__ import annotations

import time

import pytest
from conftest import FIXED, GREEDY, BurstsPolicy, make_prompts, metric_values, output_ids
from conftest import SPEC_KV as KV

from vllm_spec import LLM, SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_adaptive_policy_measures_costs_and_keeps_exploring(spec_pair, random_draft, async_scheduling):
    # An unrelated draft (acceptance near 0): the policy must measure what drafting costs (on CPU
    # about as much as a target step, on a GPU a quarter of one) and speculate only to explore.
    llm = LLM(spec_pair[0], speculative_model=str(random_draft), num_speculative_tokens=4,
              async_scheduling=async_scheduling, **KV)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    policy = llm.llm_engine.executor.worker.policy
    chosen, choose = [], policy.choose

    def record(shape):   # the all-decoding steps (the ones measured per k)
        k = choose(shape)
        if shape.seq_ids and not shape.num_other_tokens:
            chosen.append(max(k))
        return k

    policy.choose = record
    llm.generate(make_prompts(2), params, use_tqdm=False)
    m = metric_values(llm)
    assert m["vllm:spec_decode_policy_draft_cost_ratio"] > 0.05
    # Exploration: at least one speculative step; once the first quarter of the steps has taught the
    # policy what speculation costs, what re-measuring a k (not its first measurement) loses against
    # plain steps, on the policy's own measurements, stays small. A loose bound: over a few hundred
    # steps the acceptance belief is still broad and its draws ask for a speculative step now and
    # then (up to ~10% of the time on CPU, where such a step costs several plain ones); it guards
    # against re-measuring on a fixed schedule or speculating throughout (which lose 50-400%). The
    # spacing rule itself is tested in test_adaptive_policy.py. (On an H200 every k of the tiny pair
    # costs about a plain step: re-measurements are frequent there and cheap.)
    assert any(chosen), chosen
    start = len(chosen) // 4
    again = [k for i, k in enumerate(chosen) if i >= start and k and k in chosen[:i]]
    cost = {k: policy._costs.measured[(2, k)].seconds for k in set(chosen)}
    assert sum(cost[k] - cost[0] for k in again) <= 0.15 * (len(chosen) - start) * cost[0], (chosen, cost)


class _Recording(BurstsPolicy):
    """BurstsPolicy that keeps what each step's observation said: (speculated, verify seconds, charge)."""

    def __init__(self, period: int):
        super().__init__(period)
        self.seen: list[tuple[bool, float, float]] = []

    def observe(self, shape, chosen, accepted, stats, charge, found=None) -> None:
        self.seen.append((max(chosen, default=0) > 0, stats.verify_time, charge.seconds))


def test_verification_time_stops_where_the_host_starts_reading(spec_pair, monkeypatch):
    """A verification's time is the target pass and the verdict, up to where the host waits for the
    accepted tokens: the host's preparation of the pass before it and what the host does with the
    tokens after it (here both made slow) are the step's, not the verification's. Plain steps in
    between are timed the same way, from their pass's launch."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3,
              async_scheduling=False, **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    worker.policy = policy = _Recording(period=2)
    slow = 0.05
    logprobs = worker.scorer._logprobs

    def slow_logprobs(*args):
        time.sleep(slow)
        return logprobs(*args)

    monkeypatch.setattr(worker.scorer, "_logprobs", slow_logprobs)
    runner = worker.target.runner
    prepare = runner.prepare

    def slow_prepare(*args, **kwargs):
        time.sleep(slow)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(runner, "prepare", slow_prepare)
    llm.generate(make_prompts(2), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    spec = [(verify, charge) for speculated, verify, charge in policy.seen if speculated]
    plain = [verify for speculated, verify, _ in policy.seen if not speculated]
    assert spec and plain
    assert all(charge >= slow > verify for verify, charge in spec), spec
    assert all(0.0 <= verify < slow for verify in plain), plain


@pytest.mark.parametrize("speculate", [True, False])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_costs_count_the_host_and_the_caller_but_not_an_idle_engine(spec_pair, async_scheduling, speculate):
    """The policy's step costs run from read to read: the host's work before a step (here a slow
    choice of k) and the caller's between steps while requests run (a server's dispatch of outputs)
    are what serving them cost; time with no request at all (an idle server) is no step's cost, also
    after the last requests were aborted."""
    engine = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, speculative_policy="fixed",
                 async_scheduling=async_scheduling, **KV).llm_engine
    if not speculate:   # plain steps, overlapped if async (a threshold of 1: below what users may set)
        engine.config.speculative.disable_by_batch_size = 1
    policy = engine.executor.worker.policy
    choose, observe, charges = policy.choose, policy.observe, []

    def slow_choice(shape):
        time.sleep(0.02)
        return choose(shape)

    def record(shape, chosen, accepted, stats, charge, found=None):
        charges.append((shape.num_other_tokens == 0, charge.seconds))
        observe(shape, chosen, accepted, stats, charge, found)

    policy.choose, policy.observe = slow_choice, record

    def serve(request_id: str, steps: int | None = None) -> None:
        engine.add_request(request_id, make_prompts(1)[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished_requests() and steps != 0:
            engine.step()
            time.sleep(0.1)   # the caller's work
            steps = None if steps is None else steps - 1

    serve("0")
    time.sleep(0.6)   # idle
    serve("1", steps=3)
    engine.abort_request("1")
    time.sleep(0.6)   # idle again
    serve("2")
    serve("3", steps=1)   # the worker learns from a step while the next runs: here, from "2"'s last
    # Each request's steps, from its prompt's step (the one step here that is not all decoding).
    runs: list[list[tuple[bool, float]]] = []
    for is_decoding, c in charges:
        if not is_decoding:
            runs.append([])
        runs[-1].append((is_decoding, c))
    first, second, third = runs[:3]
    # Decoding steps after a decoding step cost at least the caller's turn and the choice before them.
    # (With async scheduling the first one after the prefill was launched, its choice made, while the
    # prefill was in flight: read right after it; the last one, read when no step was left to launch,
    # had no choice after it.)
    for run in (first, third):
        decoding = [c for is_decoding, c in run if is_decoding][1:]
        assert len(decoding) >= 3 and all(c >= 0.1 for c in decoding), run
        assert all(c >= 0.12 for c in decoding[:-1]), run
    assert all(c < 0.5 for _, c in first + second + third), (first, second, third)


def test_a_stalled_engine_is_idle_for_the_step_costs(spec_pair, monkeypatch):
    """Steps that run nothing (requests waiting for KV blocks) leave the engine waiting: that wait is
    no step's cost."""
    from vllm_spec.core.scheduler import SchedulerOutput

    engine = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=2, speculative_policy="fixed",
                 **KV).llm_engine
    policy = engine.executor.worker.policy
    observe, charges = policy.observe, []
    policy.observe = lambda shape, chosen, accepted, stats, charge, found=None: (
        charges.append(charge.seconds), observe(shape, chosen, accepted, stats, charge, found))
    engine.add_request("0", make_prompts(1)[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: SchedulerOutput())
    for _ in range(3):
        assert engine.step() == []
        time.sleep(0.2)
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    seen = len(charges)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(charges) > seen and all(c < 0.3 for c in charges[seen:]), charges


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("bursts", [False, True], ids=["adaptive", "bursts"])
def test_the_policy_learns_from_every_step_in_order(spec_pair, async_scheduling, bursts):
    """The policy learns from a step while a later one runs: from every step, once, in the order
    they ran (plain steps read late under async scheduling included), and a sequence that finished
    is forgotten only after the lessons about it (it never comes back)."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3,
              async_scheduling=async_scheduling, **KV)
    worker = llm.llm_engine.executor.worker
    if bursts:   # plain and speculative steps alternate: plain ones are read after the next launch
        worker.policy = BurstsPolicy(period=3)
    policy = worker.policy
    chosen, calls = [], []
    choose, observe, release = policy.choose, policy.observe, policy.release

    def recording_choose(shape):
        chosen.append(shape)
        return choose(shape)

    def recording_observe(shape, *args):
        calls.append(("observe", shape))
        observe(shape, *args)

    def recording_release(seq_ids):
        calls.append(("release", list(seq_ids)))
        release(seq_ids)

    policy.choose, policy.observe, policy.release = recording_choose, recording_observe, recording_release
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(make_prompts(3), params, use_tqdm=False)
    first = len(chosen)
    llm.generate(make_prompts(1, seed=5), params, use_tqdm=False)   # its steps teach the first call's last
    observed = [shape for call, shape in calls if call == "observe"]
    assert len(observed) >= first and all(a is b for a, b in zip(observed, chosen))
    released = set()
    for call, arg in calls:
        if call == "release":
            released.update(arg)
        else:
            assert not released & set(arg.seq_ids)
    assert len(released) == 3
    if not bursts:
        assert not released & set(policy._acceptance.seqs)


def test_the_chosen_k_metric_is_the_read_steps(spec_pair):
    """vllm:spec_decode_policy_mean_k is the k chosen for the step just read, not the one the
    adaptive policy has already prepared for the next step."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[0], num_speculative_tokens=3, async_scheduling=False, **KV)
    engine = llm.llm_engine
    policy = engine.executor.worker.policy
    chosen, choose = [], policy.choose
    policy.choose = lambda shape: chosen.append(choose(shape)) or chosen[-1]
    # (Draft = target costs about what it saves: the policy's first speculative steps are measurements,
    # which a loaded machine can push past a short request.)
    engine.add_request("0", make_prompts(1)[0], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((metric_values(llm)["vllm:spec_decode_policy_mean_k"], sum(chosen[-1]) / max(len(chosen[-1]), 1)))
    assert all(metric == step for metric, step in seen), seen
    assert {step > 0 for _, step in seen} == {False, True}   # plain steps first (measured), then speculative


@pytest.mark.policy_failures
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_policy_that_fails_to_learn_does_not_fail_the_steps(spec_pair, greedy_reference, async_scheduling, caplog):
    """What the policy learns is advisory: a lesson that raises (here every third) is logged, the
    other lessons and releases of the same window still reach the policy, and the steps around it
    (already on the device) run and are read as any other: outputs unchanged."""
    llm = LLM(spec_pair[0], speculative_model=spec_pair[1], num_speculative_tokens=3,
              async_scheduling=async_scheduling, **KV)
    policy = llm.llm_engine.executor.worker.policy   # the adaptive one
    chosen, lessons = [], []
    choose, observe = policy.choose, policy.observe

    def recording_choose(shape):
        chosen.append(shape)
        return choose(shape)

    def failing(*args):
        lessons.append(args)
        if len(lessons) % 3 == 0:
            raise RuntimeError("policy bug")
        observe(*args)

    policy.choose, policy.observe = recording_choose, failing
    with caplog.at_level("ERROR"):
        assert output_ids(llm.generate(make_prompts(16), GREEDY, use_tqdm=False)) == greedy_reference
        steps = len(chosen)
        finished = {sid for shape in chosen for sid in shape.seq_ids}   # the first call's sequences
        llm.generate(make_prompts(1), GREEDY, use_tqdm=False)   # its steps teach the first call's last
    assert "failed in" in caplog.text and len(lessons) >= steps >= 3
    assert len(finished) == 16 and not finished & set(policy._acceptance.seqs)   # released despite the failures


def test_drafts_the_proposer_did_not_find_are_no_trials(spec_pair):
    """An n-gram proposer may find fewer drafts than asked, or none: the policy is told both what it
    asked and what was found, so a draft never proposed is no rejection (no match does not drive the
    acceptance estimate to 0) and asking is learned as worth what finding is."""
    llm = LLM(spec_pair[0], speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=3,
              **FIXED, **KV)
    worker = llm.llm_engine.executor.worker
    found_per_step, propose = [], worker.proposer.propose

    def recording(*args, **kwargs):
        proposals = propose(*args, **kwargs)
        found_per_step.append(list(proposals.num_drafts))
        return proposals

    worker.proposer.propose = recording
    learned, observe = [], worker.policy.observe

    def record(shape, chosen, accepted, stats, charge, found=None):
        learned.append((list(chosen), list(chosen if found is None else found)))
        observe(shape, chosen, accepted, stats, charge, found)

    worker.policy.observe = record
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7, 8] + list(range(20, 40))}   # one match, then none
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    speculative = [found for found in found_per_step if found]
    assert speculative and any(f[0] < 3 for f in speculative), found_per_step
    decoding = [(asked, found) for asked, found in learned if any(asked)]
    # (the last step is learned from while a later one runs: there is none)
    assert len(decoding) == len(speculative) - 1 and all(asked == [3] for asked, _ in decoding)
    assert [found for _, found in decoding] == speculative[:-1]
