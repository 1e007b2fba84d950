"""Shared fixtures: tiny random Llama-family checkpoints and a tiny BPE tokenizer, built in seconds;
and what the end-to-end speculative decoding tests share (engine settings, prompts, references)."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from vllm_spec import LLM, SamplingParams

# Tiny models gain nothing from intra-op threads, and two threads on a busy 2-core machine
# are many times slower than one. Subprocesses (CLI, server) inherit the setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

TINY_VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _policy_failures_fail_the_test(request):
    """The worker logs a failure of the speculation policy and serves on (its work is advisory): a
    test fails on one all the same, unless marked policy_failures (it provokes them)."""
    handler = _Records()
    logger = logging.getLogger("vllm_spec.spec_decode.spec_decode_worker")
    logger.addHandler(handler)
    yield
    logger.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("policy_failures") is None:
        pytest.fail(f"the speculation policy failed: {handler.format(handler.records[0])}")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run opt-in tests on real checkpoints")
    parser.addoption("--target-model", default=os.environ.get("VLLM_SPEC_TEST_TARGET"),
                     help="target model for the e2e tests (default: a tiny random model)")
    parser.addoption("--draft-model", default=os.environ.get("VLLM_SPEC_TEST_DRAFT"),
                     help="draft model for the e2e tests (default: a tiny random model)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--run-slow"):
        skip = pytest.mark.skip(reason="opt-in: pass --run-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


def _train_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (Path(os.__file__).parent / "textwrap.py").read_text().splitlines() * 2
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF checkpoint (+ tokenizer) of the given family into folder."""
    import transformers as tf

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=0, eos_token_id=0, rms_norm_eps=1e-6)
    if arch in ("gpt2", "gpt_bigcode"):   # (their own key names)
        base = dict(vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=0,
                    eos_token_id=0, pad_token_id=1)
    if arch in ("opt", "gpt_neox"):   # (every head a KV head, LayerNorm's eps; OPT's ffn_dim)
        base = dict(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=512, bos_token_id=0, eos_token_id=0, pad_token_id=1,
                    **({"ffn_dim": 128} if arch == "opt" else {"intermediate_size": 128}))
    base.update(overrides)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM), "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
           "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM), "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
           "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM), "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
           "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM), "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
           "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
           "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM), "opt": (tf.OPTConfig, tf.OPTForCausalLM),
           "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM), "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel),
           "gpt_bigcode": (tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM),
           "phi": (tf.PhiConfig, tf.PhiForCausalLM)}[arch]
    # (4 experts, 2 a token: transformers' 8 (128) would make a tiny model slow)
    if arch == "mixtral":
        base = dict(num_local_experts=4, num_experts_per_tok=2) | base
    if arch in ("qwen3_moe", "qwen2_moe"):
        base = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                    shared_expert_intermediate_size=80) | base
    if arch in ("phi3", "smollm3"):
        base.setdefault("pad_token_id", 0)   # (their defaults, 32000 and 128004, are no tiny vocabulary's rows)
    small_biases = arch in ("opt", "gpt_neox", "gpt2", "gpt_bigcode", "phi")
    torch.manual_seed(seed)
    model = cls[1](cls[0](**base)).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than HF's init: peaked, varied distributions
            # (biases of every projection (OPT, GPT-NeoX, GPT-2, Phi): small enough to leave the tokens their say)
            p.normal_(0.0, 0.1 if p.dim() > 1 else 0.05 if small_biases else 0.5)
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):   # Qwen3's per-head norms: each its own scale
                p.normal_(1.0, 0.5)
            elif "norm" in name:   # (LayerNorms' biases: 0, else a shared offset rules every token)
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _train_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie_word_embeddings=False, seed=1)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=2, sliding_window=None)


@torch.no_grad()
def assert_matches_transformers(llm, path: Path, prompts: list[list[int]], new_tokens: int = 8) -> None:
    """Our greedy tokens and prompt logprobs of each prompt (token ids) are transformers' (float32, eager)."""
    import transformers as tf

    from vllm_spec import SamplingParams

    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, use_cache=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        logits = hf(x).logits[0, :-1].log_softmax(-1)
        torch.testing.assert_close(ours, logits.gather(1, x[0, 1:, None]).squeeze(1), atol=1e-4, rtol=1e-4)


def edit_checkpoint(path: Path, change) -> None:
    """Apply change(weights) to a tiny checkpoint's tensors (a dict: pop, add or replace them) and save them."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def finish_gguf(writer) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_with_config(model: str | Path, folder: Path, **changes) -> str:
    """A copy of a checkpoint folder whose config.json has these keys set."""
    shutil.copytree(model, folder, dirs_exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return str(folder)


def make_noisy_draft(target: Path, folder: Path, noise: float, seed: int = 0) -> Path:
    """A draft = the target's weights plus Gaussian noise: partial acceptance, same tokenizer."""

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(str(target / "model.safetensors"))
    noisy = {k: (v + noise * torch.randn(v.shape, generator=gen) * v.std()).contiguous() if v.dim() > 1 else v
             for k, v in weights.items()}
    save_file(noisy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def spec_pair(request, tmp_path_factory, tiny_llama) -> tuple[str, str]:
    """(target, draft) for the e2e tests: --target-model/--draft-model, else a tiny target and a noisy copy."""
    target = request.config.getoption("--target-model")
    draft = request.config.getoption("--draft-model")
    if target and draft:
        return target, draft
    return str(tiny_llama), str(make_noisy_draft(tiny_llama, tmp_path_factory.mktemp("noisy_draft"), 0.04))


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory) -> Path:
    """An unrelated random model with the tiny vocabulary: acceptance near 0."""
    return make_tiny_model(tmp_path_factory.mktemp("random_draft"), "llama", seed=9, num_hidden_layers=1)


# End-to-end speculative decoding ------------------------------------------------------------
SPEC_KV = dict(kv_cache_memory_bytes=1 << 25)
# Tests that count drafts pin k; the adaptive policy (the default) has its own tests.
FIXED = dict(speculative_policy="fixed")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, for kernels against their references; NaN never passes
    (an output element the kernel did not write, over a poisoned buffer)."""
    assert not torch.isnan(out).any(), "NaN in output: an element was not written"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def make_prompts(n: int, seed: int = 0, vocab: int = 300) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))]} for _ in range(n)]


def output_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def metric_values(llm) -> dict:
    return {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()}


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(spec_pair):
    """The non-speculative engine on the spec pair's target."""
    return LLM(spec_pair[0], **SPEC_KV)


@pytest.fixture(scope="module")
def greedy_reference(baseline):
    return output_ids(baseline.generate(make_prompts(16), GREEDY, use_tqdm=False))


class ScriptedPolicy:
    """A speculation policy whose choices a test scripts (choose); it learns nothing."""

    def choose(self, shape) -> list[int]:
        raise NotImplementedError

    def observe(self, *args) -> None:
        pass

    def prepare(self, shape) -> None:
        pass

    def release(self, seq_ids) -> None:
        pass

    def estimates(self):
        from vllm_spec.worker.batch import PolicyEstimates
        return PolicyEstimates()


class BurstsPolicy(ScriptedPolicy):
    """Speculates (k = 3) on one step in `period`, not at all on the others: the draft lags, then catches up."""

    def __init__(self, period: int):
        self.period, self.steps = period, 0

    def choose(self, shape) -> list[int]:
        self.steps += 1
        return [min(cap, 3) if self.steps % self.period == 0 else 0 for cap in shape.caps]


class KPerSequencePolicy(ScriptedPolicy):
    """Drafts k = (sequence id mod 4), at most the cap: verification passes of k per sequence."""

    def choose(self, shape) -> list[int]:
        return [min(cap, sid % 4) for sid, cap in zip(shape.seq_ids, shape.caps)]


class EagerGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the captured function into
    the same output tensor, so the static-buffer bookkeeping around graphs runs without a GPU."""

    def __init__(self, run):
        self._run = run
        self.out = run()
        self.replays = 0

    def replay(self) -> None:
        self.out.copy_(self._run())
        self.replays += 1

    def pool(self) -> None:
        return None


def eager_capture(run, pool=None):
    """cuda_graph.capture_graph's stand-in: (graph, its output)."""
    graph = EagerGraph(run)
    return graph, graph.out


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the Ray executor's tests (skipped where Ray cannot start one)."""
    try:
        import ray
    except ImportError:
        pytest.skip("Ray is not installed (pip install ray): the Ray executor tests cannot run here.")
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        except Exception as e:  # noqa: BLE001 - reported as the skip reason
            pytest.skip(f"Ray could not start a local cluster here: {type(e).__name__}: {e}")
    yield ray
    if started:
        ray.shutdown()
