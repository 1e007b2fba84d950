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


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=5, head_dim=32, attention_bias=True)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    # (a 4-token window on layer 0, which rotates with the local base; norms stored as offsets from 1)
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", seed=6, head_dim=32, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"])


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    # (both soft caps small enough to change every attention score and logit)
    return make_tiny_model(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", seed=7, head_dim=32, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=1.0,
                           final_logit_softcapping=2.0)


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    # (its fused checkpoint tensors split on load; every layer windowed)
    return make_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), "phi3", seed=8, sliding_window=6)


@needs_kernel
@pytest.mark.parametrize("model, dtype", [("tiny_llama", "float32"), ("tiny_qwen2", "float32"),
                                          ("tiny_phi3", "float32"),
                                          ("tiny_windowed", "float32"), ("tiny_qwen2", "bfloat16"),
                                          ("tiny_qwen3", "float32"), ("tiny_qwen3", "bfloat16"),
                                          ("tiny_gemma3", "float32"), ("tiny_gemma3", "bfloat16"),
                                          ("tiny_gemma2", "float32"), ("tiny_gemma2", "bfloat16")])
def test_the_decoder_gives_the_python_layers_bits(model, dtype, request, monkeypatch):
    """Plain decoding (greedy and sampled, logprobs) with biases (Qwen2), a sliding window, per-head query/key
    norms (Qwen3), Gemma 3's layers, Gemma 2's soft-capped attention and bfloat16: token for token and logprob for logprob the Python layers'
    run."""
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


def _q8_0_values(w: torch.Tensor) -> torch.Tensor:
    """w rounded to GGUF Q8_0 values (float16 scale per 32 columns, q in -127..127): blocks hold it exactly."""
    blocks = w.view(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(2 ** -14)
    return (d * (blocks / d).round().clamp(-127, 127)).view_as(w)


def _biased_llama(dtype: torch.dtype, weights: str):
    """A 3-layer Llama with every bias (q/k/v, o, MLP) and random norm weights, packed for the CPU."""
    from vllm_spec.distributed.parallel_state import GroupCoordinator
    from vllm_spec.model.arch_config import ArchConfig
    from vllm_spec.model.llama import LlamaForCausalLM

    cfg = ArchConfig.from_hf_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=96,
                                       intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
                                       num_key_value_heads=2, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, GroupCoordinator(), dtype, 256)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 0.8)
            if p.dim() > 1 and "embed" not in name and "lm_head" not in name:
                p.copy_({"plain": p, "bf16_exact": p.bfloat16().float(), "q8_0": _q8_0_values(p)}[weights])
    model.pack_for_cpu()
    return model


def _forward_steps(model, dtype, decoder: bool) -> list[torch.Tensor]:
    """Hidden states of one sequence's steps of 5, 1, 9, 16, 0 and 2 tokens over fresh caches."""
    from vllm_spec.attention.metadata import AttentionMetadata

    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(8, 16, attn.num_kv_heads, attn.head_dim, dtype=dtype)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    built, model.cpu_decoder = model.cpu_decoder, model.cpu_decoder if decoder else None
    gen, seq, outs = torch.Generator().manual_seed(1), 0, []
    table = torch.tensor([[1, 2, 3, 4]])
    for T in (5, 1, 9, 16, 0, 2):
        positions = torch.arange(seq, seq + T)
        seq += T
        md = AttentionMetadata(torch.tensor([0, T]), torch.tensor([seq]), table,
                               table[0, positions // 16] * 16 + positions % 16, T, seq, 16)
        with torch.inference_mode():
            outs.append(model(torch.randint(0, 100, (T,), generator=gen), positions, md))
    model.cpu_decoder = built
    return outs


@needs_kernel
@pytest.mark.parametrize("dtype, weights", [(torch.float32, "plain"), (torch.float32, "bf16_exact"),
                                            (torch.float32, "q8_0"), (torch.bfloat16, "plain")])
def test_every_bias_norm_and_weight_storage_gives_the_python_layers_bits(dtype, weights, monkeypatch):
    """The model's forward with and without the decoder, step by step (0 to 16 tokens): column- and
    row-parallel biases, random norm weights, weights stored as float32, exact bf16 or Q8_0 blocks."""
    if dtype == torch.bfloat16 and torch.bfloat16 not in cpu_linear.dtypes():
        pytest.skip("this CPU multiplies bfloat16 in oneDNN (native bf16): the Python layers run it")
    model = _biased_llama(dtype, weights)
    assert model.cpu_decoder is not None
    if weights != "plain":
        assert {type(layer.mlp.down_proj.packed).__name__ for layer in model.layers} == \
            {"BlockWeight" if weights == "q8_0" else "Tensor"}
    used = _count_steps(monkeypatch)
    ours = _forward_steps(model, dtype, decoder=True)
    assert used == [True] * 6
    for a, b in zip(ours, _forward_steps(model, dtype, decoder=False)):
        assert a.dtype == b.dtype and torch.equal(a, b)


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
    norm = layers[1].post_attention_layernorm.weight
    norm.requires_grad_()   # (the Python path's ops then are torch's)
    assert CpuDecoder.build(layers) is None
    norm.requires_grad_(False)
    layers[1].self_attn.rotary_dim = layers[1].self_attn.head_dim // 2   # (Phi-3's partial rotation)
    assert CpuDecoder.build(layers) is None
    layers[1].self_attn.rotary_dim = layers[1].self_attn.head_dim
    layers[1].self_attn.rotates = False   # (SmolLM3's NoPE layers)
    assert CpuDecoder.build(layers) is None


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
        model.cpu_decoder.decoder.forward(x, cos, cos, [], [], *meta)
    caches = [a.k_cache for a in model.cpu_decoder.attentions], [a.v_cache for a in model.cpu_decoder.attentions]
    meta[0] = torch.tensor([caches[0][0].numel()])   # past the last slot
    with pytest.raises(RuntimeError, match="outside the cache"):
        model.cpu_decoder.decoder.forward(x, cos, cos, *caches, *meta)
