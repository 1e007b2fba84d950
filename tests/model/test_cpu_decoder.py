"""The CPU's decoder layers in one C++ call (vllm_spec/model/cpu_decoder.py): the bits of the Python
layers for every step it takes, and the Python layers for every step and model it does not take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_model
from vllm_spec import LLM, SamplingParams, cpu_ops
from vllm_spec.attention import torch_backend
from vllm_spec.model import cpu_linear
from vllm_spec.model.cpu_decoder import CpuDecoder

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no AVX2 CPU kernel here (or not buildable)")

# Prompts of 1-40 tokens: the short ones' prefill is a short query block too, the long ones' are not.
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 3, 17, 40)] + ["hello world"]


def _model(llm: LLM):
    return llm.llm_engine.executor.worker.runner.model


def _count_steps(monkeypatch) -> list[bool]:
    """Whether each forward ran in the decoder (True) or handed the step back (False)."""
    used: list[bool] = []
    original = CpuDecoder.forward

    def forward(self, *args):
        out = original(self, *args)
        used.append(out is not None)
        return out

    monkeypatch.setattr(CpuDecoder, "forward", forward)
    return used


def _outputs(llm: LLM, params: list[SamplingParams]) -> list:
    return [(c.token_ids, c.logprobs, c.cumulative_logprob)
            for p in params for o in llm.generate(PROMPTS, p, use_tqdm=False) for c in o.outputs]


def _python_layers(monkeypatch) -> None:
    monkeypatch.setattr(CpuDecoder, "build", classmethod(lambda cls, layers: None))


PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)]


@pytest.fixture(scope="module")
def tiny_windowed(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_windowed"), "mistral", seed=4, sliding_window=8)


@needs_kernel
@pytest.mark.parametrize("model, dtype", [("tiny_llama", "float32"), ("tiny_qwen2", "float32"),
                                          ("tiny_windowed", "float32"), ("tiny_qwen2", "bfloat16")])
def test_the_decoder_gives_the_python_layers_bits(model, dtype, request, monkeypatch):
    """Plain decoding (greedy and sampled, logprobs) with biases (Qwen2), a sliding window and bfloat16:
    token for token and logprob for logprob the Python layers' run."""
    if dtype == "bfloat16" and torch.bfloat16 not in cpu_linear.dtypes():
        pytest.skip("this CPU multiplies bfloat16 in oneDNN (native bf16): the Python layers run it")
    path = str(request.getfixturevalue(model))
    used = _count_steps(monkeypatch)
    llm = LLM(model=path, dtype=dtype, kv_cache_memory_bytes=1 << 22, device="cpu")
    assert _model(llm).cpu_decoder is not None
    ours = _outputs(llm, PARAMS)
    assert True in used and False in used   # (decode steps; the 17- and 40-token prompts' prefill)
    del llm
    _python_layers(monkeypatch)
    llm = LLM(model=path, dtype=dtype, kv_cache_memory_bytes=1 << 22, device="cpu")
    assert _model(llm).cpu_decoder is None
    assert _outputs(llm, PARAMS) == ours


@needs_kernel
@pytest.mark.parametrize("draft", ["model", "[ngram]"])
def test_verification_and_the_drafts_steps_give_the_same_bits(tiny_llama, draft, monkeypatch):
    """Speculative decoding: the target's k+1-token verification and the draft's steps in the decoder,
    outputs bit for bit those of the Python layers (and of plain decoding, greedy)."""
    path = str(tiny_llama)
    spec = dict(speculative_model=path, num_speculative_tokens=4, speculative_policy="fixed") if draft == "model" \
        else dict(speculative_model=draft, num_speculative_tokens=4, speculative_policy="fixed",
                  ngram_prompt_lookup_max=2)

    def run():
        return _outputs(LLM(model=path, kv_cache_memory_bytes=1 << 22, device="cpu", **spec), PARAMS)

    used = _count_steps(monkeypatch)
    ours = run()
    assert True in used
    _python_layers(monkeypatch)
    assert run() == ours


@needs_kernel
def test_a_forced_attention_backend_keeps_the_python_layers(tiny_llama, monkeypatch):
    used = _count_steps(monkeypatch)
    llm = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu")
    for attn in _model(llm).attention_layers():
        attn.backend = torch_backend
    ours = _outputs(llm, PARAMS[:1])
    assert used and True not in used
    _python_layers(monkeypatch)
    ref = LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu")
    for attn in _model(ref).attention_layers():
        attn.backend = torch_backend
    assert _outputs(ref, PARAMS[:1]) == ours


@needs_kernel
def test_layers_it_cannot_run_are_not_built(tiny_llama):
    model = _model(LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu"))
    layers = list(model.layers)
    assert len(CpuDecoder.build(layers).decoder) == len(layers)
    assert CpuDecoder.build([]) is None
    saved = layers[1].self_attn.o_proj.tp
    layers[1].self_attn.o_proj.tp = SimpleNamespace(world_size=2)   # tensor parallel: all-reduces
    assert CpuDecoder.build(layers) is None
    layers[1].self_attn.o_proj.tp = saved
    proj = layers[0].mlp.down_proj
    saved = proj.weight
    proj.weight = torch.nn.Parameter(proj.weight.to(torch.float64), requires_grad=False)   # not the kernel's
    assert CpuDecoder.build(layers) is None
    proj.weight = saved


@needs_kernel
def test_steps_it_does_not_take_are_handed_back(tiny_llama):
    """A long query block, a cache in another dtype, queries that need autograd: None (the Python layers)."""
    model = _model(LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu"))
    decoder = model.cpu_decoder
    T, D = 3, model.config.head_dim
    x = torch.randn(T, model.config.hidden_size)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)

    def md(max_query_len):
        return SimpleNamespace(max_query_len=max_query_len, slot_mapping=torch.arange(16, 16 + T),
                               block_tables=torch.tensor([[1, 2]]), seq_lens=torch.tensor([T]),
                               query_start_loc=torch.tensor([0, T]))

    assert decoder.forward(x, cos, sin, md(torch_backend.SHORT_QUERY + 1)) is None
    assert decoder.forward(x, cos.double(), sin.double(), md(T)) is None
    with torch.enable_grad():
        assert decoder.forward(x.requires_grad_(), cos, sin, md(T)) is None
    x = x.detach()
    out, residual = decoder.forward(x, cos, sin, md(T))
    assert out.shape == residual.shape == x.shape and torch.isfinite(out).all()
    attn = decoder.attentions[0]
    saved = attn.k_cache
    attn.k_cache = saved.bfloat16()
    assert decoder.forward(x, cos, sin, md(T)) is None
    attn.k_cache = saved


@needs_kernel
def test_the_extension_names_what_it_was_given_wrong(tiny_llama):
    """Caches that do not match the layers, a slot past the cache: errors that say so."""
    model = _model(LLM(model=str(tiny_llama), kv_cache_memory_bytes=1 << 22, device="cpu"))
    meta = [torch.tensor([16]), torch.tensor([[1]]), torch.tensor([1]), torch.tensor([0, 1])]
    x, cos = torch.randn(1, model.config.hidden_size), torch.ones(1, model.config.head_dim)
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        model.cpu_decoder.decoder.forward(x, cos, cos, [], [], *meta, 16)
    caches = [a.k_cache for a in model.cpu_decoder.attentions], [a.v_cache for a in model.cpu_decoder.attentions]
    meta[0] = torch.tensor([caches[0][0].numel()])   # past the last slot
    with pytest.raises(RuntimeError, match="outside the cache"):
        model.cpu_decoder.decoder.forward(x, cos, cos, *caches, *meta, 16)
