"""The architecture description of a Llama-family decoder, read from an HF config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_spec.model.gpt2_config import GPT2_KEYS, read_gpt2
from vllm_spec.model.gpt_neox_config import NeoxConfig, read_gpt_neox, read_phi
from vllm_spec.model.moe_config import MoeConfig, read_moe
from vllm_spec.model.opt_config import OptConfig, read_opt
from vllm_spec.model.rope_config import read_rope
from vllm_spec.model.window_config import nope_layers, read_windows
from vllm_spec.utils import FLOAT32_MAX, check_int, is_float32_scale, is_int, is_number

# HF architecture name -> whether q/k/v projections carry a bias by default.
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "GraniteForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3ForCausalLM": False,
    "Gemma2ForCausalLM": False,
    "Gemma3ForCausalLM": False,
    "Phi3ForCausalLM": False,
    "MixtralForCausalLM": False,
    "Qwen3MoeForCausalLM": False,
    "Qwen2MoeForCausalLM": True,
    "GemmaForCausalLM": False,
    "SmolLM3ForCausalLM": False,
    "OPTForCausalLM": True,
    "GPTNeoXForCausalLM": True,
    "GPT2LMHeadModel": True,
    "GPTBigCodeForCausalLM": True,
    "PhiForCausalLM": True,
}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 1 too: embeddings times sqrt(hidden_size), norm weights as offsets from 1, tied embeddings by default.
_GEMMA_FAMILY = ("GemmaForCausalLM", *_GEMMA)
# A config without "architectures" names its model_type (transformers loads it from that).
_ARCH_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "granite": "GraniteForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                       "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                       "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                       "qwen2_moe": "Qwen2MoeForCausalLM", "gemma": "GemmaForCausalLM",
                       "smollm3": "SmolLM3ForCausalLM", "opt": "OPTForCausalLM",
                       "gpt_neox": "GPTNeoXForCausalLM", "gpt2": "GPT2LMHeadModel",
                       "gpt_bigcode": "GPTBigCodeForCausalLM", "phi": "PhiForCausalLM"}
# Architectures whose attention_bias biases q, k, v and o_proj (Qwen2's fixed q/k/v biases, Mistral's none).
_CONFIGURED_BIAS = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "Qwen3ForCausalLM",
                    "Qwen3MoeForCausalLM", "OPTForCausalLM", "GPTNeoXForCausalLM", "GPT2LMHeadModel",
                    "GPTBigCodeForCausalLM", "PhiForCausalLM", *_GEMMA_FAMILY)
# Architectures whose mlp_bias biases the MLP projections (OPT's enable_bias, read as both; GPT-NeoX's, GPT-2's,
# GPT-BigCode's and Phi's always).
_MLP_BIAS = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM", "OPTForCausalLM", "GPTNeoXForCausalLM",
             "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "PhiForCausalLM")
# Granite's scalars (transformers' defaults 1): embeddings times embedding_multiplier, each block's output times
# residual_multiplier before its residual add, attention scaled by attention_multiplier, logits / logits_scaling.
_GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# transformers' soft caps for a Gemma config.json without the keys: (attention scores, final logits).
_GEMMA_SOFTCAPS = {"Gemma2ForCausalLM": (50.0, 30.0), "Gemma3ForCausalLM": (None, None)}
# transformers' values for keys a config.json leaves out (Llama's: all heads, hidden / heads, 2048).
_ABSENT = {
    "MistralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=131072),
    "Qwen2ForCausalLM": dict(num_key_value_heads=32, max_position_embeddings=32768),
    "Qwen3ForCausalLM": dict(num_key_value_heads=32, max_position_embeddings=32768, head_dim=128),
    "GemmaForCausalLM": dict(num_key_value_heads=16, max_position_embeddings=8192, head_dim=256),
    "SmolLM3ForCausalLM": dict(num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=True),
    "Gemma2ForCausalLM": dict(num_key_value_heads=4, max_position_embeddings=8192, head_dim=256),
    "Gemma3ForCausalLM": dict(num_key_value_heads=4, max_position_embeddings=131072, head_dim=256),
    "Phi3ForCausalLM": dict(max_position_embeddings=4096, rms_norm_eps=1e-5),
    "MixtralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5),
    "Qwen3MoeForCausalLM": dict(num_key_value_heads=4, max_position_embeddings=32768),
    "Qwen2MoeForCausalLM": dict(num_key_value_heads=16, max_position_embeddings=32768),
}
# Our names of config keys that a family's config.json spells otherwise.
_CONFIG_KEYS = {"OPTForCausalLM": {"intermediate_size": "ffn_dim"},
                **dict.fromkeys(("GPT2LMHeadModel", "GPTBigCodeForCausalLM"),
                                {ours: theirs for theirs, ours in GPT2_KEYS.items()})}
# transformers' names of the MLP activations -> ours (layers.ACTIVATION_FNS): SiLU, GELU and its tanh approximation
# (Gemma's), ReLU (OPT's), x * sigmoid(1.702 x).
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu", "quick_gelu": "quick_gelu"}
CPU_WEIGHT_FORMATS = ("q8_0",)   # ArchConfig.cpu_weights


@dataclass
class ArchConfig:
    """Shapes and options of one decoder: a Llama-family model (Llama, Granite, Mistral, Mixtral, Qwen2, Qwen3,
    Qwen2/3-MoE, Gemma 1-3, Phi-3, SmolLM2 and 3), OPT, GPT-2 or GPT-BigCode (their own options in `opt`) or
    GPT-NeoX or Phi (in `neox`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6   # the norms' eps (OPT's and GPT-NeoX's LayerNorms' too)
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int | None = None   # Phi-3's partial rotation: the leading rotary_dim dims of a head (None: all)
    unrotated_layers: tuple[int, ...] = ()   # SmolLM3's NoPE layers: no rotary embedding at all
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v biases
    o_proj_bias: bool = False      # Llama's attention_bias biases o_proj too (Qwen2's q/k/v bias does not)
    mlp_bias: bool = False
    moe: MoeConfig | None = None   # Mixtral's and the Qwen MoEs' sparse MLPs (None: dense MLPs)
    opt: OptConfig | None = None   # an OPT (or GPT-2, GPT-BigCode) model's own options
    neox: NeoxConfig | None = None   # a GPT-NeoX (or Phi) model's own options (both None: a Llama-family model)
    qk_norm: bool = False          # Qwen3, Gemma 3: an RMSNorm over each query and key head before the rotation
    # Gemma 2 and 3: GELU (tanh) MLP, embeddings times sqrt(hidden_size), norm weights stored as offsets from
    # 1, norms after the attention and the MLP too (before each residual add), the attention scaled by
    # query_pre_attn_scalar ** -0.5; Gemma 3's windowed layers rotated with their own base (no scaling).
    hidden_act: str = "silu"       # an ACTIVATIONS value
    embed_scale: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    attention_scale: float | None = None   # None: head_dim ** -0.5
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None   # Gemma's: logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None    # Gemma 2's: attention scores = cap * tanh(scores / cap)
    embedding_multiplier: float = 1.0   # Granite's (see _GRANITE_SCALARS)
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sliding_window: int | None = None
    # The layers that attend within sliding_window (None: all of them, as Mistral; Qwen2 windows the
    # layers from max_window_layers on, or those its layer_types call sliding).
    windowed_layers: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # A draft shipped without an embedding matrix borrows its target's (same hidden size).
    embeddings_from_target: bool = False
    # A draft that proposes only these token ids (its LM head keeps their rows: a cheaper step;
    # verification stays exact). None: the whole vocabulary.
    draft_vocab: tuple[int, ...] | None = None
    # "q8_0": on the CPU, the decoder layers' and the LM head's float32 matmul weights are held as the nearest
    # Q8_0 values and multiplied with llama.cpp's Q8_0 arithmetic (activations rounded to int8 blocks:
    # layers.quantize_for_cpu). Lossy: for a draft, whose numerics only set its acceptance. None: as loaded.
    cpu_weights: str | None = None

    def key(self, name: str) -> str:
        """The config.json key of one of our names (OPT's ffn_dim, GPT-2's n_head ...), for messages."""
        return _key(self.architecture, name)

    def sliding_window_for(self, layer: int) -> int | None:
        if self.windowed_layers is not None and layer not in self.windowed_layers:
            return None
        return self.sliding_window

    def rotates_locally(self, layer: int) -> bool:
        """Whether the layer rotates with local_rope_theta (Gemma 3's windowed layers)."""
        return self.local_rope_theta is not None and (self.windowed_layers is None or layer in self.windowed_layers)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ArchConfig":
        archs = cfg.get("architectures") or [_ARCH_OF_MODEL_TYPE.get(cfg.get("model_type"), "")]
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ValueError(f"architectures must be a list of architecture names, got {archs!r}.")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"Unsupported model architecture {[a for a in archs if a] or cfg.get('model_type')!r}; "
                f"supported architectures: {sorted(SUPPORTED_ARCHITECTURES)}."
            )
        opt = neox = None
        if arch == "OPTForCausalLM":   # (read as the Llama-family keys its own map to)
            cfg, opt = read_opt(cfg)
        elif arch == "GPTNeoXForCausalLM":
            cfg, neox = read_gpt_neox(cfg)
        elif arch == "PhiForCausalLM":
            cfg, neox = read_phi(cfg)
        elif arch in ("GPT2LMHeadModel", "GPTBigCodeForCausalLM"):
            cfg, opt = read_gpt2(cfg, bigcode=arch == "GPTBigCodeForCausalLM")
        gemma = arch in _GEMMA
        family = arch in _GEMMA_FAMILY
        # (transformers' Gemma 2 and 3 read hidden_activation alone, the others hidden_act alone; Gemma 1 takes
        # its releases' "gelu" for the tanh approximation they meant)
        act_key = "hidden_activation" if gemma else "activation_function" if opt else "hidden_act"
        act = cfg.get(act_key, "gelu_pytorch_tanh" if family else "silu")
        act = "gelu_pytorch_tanh" if arch == "GemmaForCausalLM" and act == "gelu" else act
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(f"Unsupported {act_key} {act!r} in the model config: supported: {sorted(ACTIVATIONS)}.")
        attn_softcap, softcap = (_softcap(cfg, key, arch, default)
                                 for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"),
                                                         _GEMMA_SOFTCAPS.get(arch, (None, None))))
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported: decoding attends causally.")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
            raise ValueError(f"Quantized checkpoints are not supported (quantization_config: {method!r}); "
                             "give unquantized weights or a GGUF file (dequantized on load).")
        heads = _required(cfg, "num_attention_heads")
        hidden = _required(cfg, "hidden_size")
        layers = _required(cfg, "num_hidden_layers")
        vocab = _required(cfg, "vocab_size")
        absent = _ABSENT.get(arch, {})
        kv_heads = cfg.get("num_key_value_heads", absent.get("num_key_value_heads"))
        kv_heads = heads if kv_heads is None else kv_heads
        if not (is_int(heads) and is_int(kv_heads) and 0 < kv_heads <= heads and heads % kv_heads == 0):
            raise ValueError(f"num_attention_heads ({heads!r}) must be a positive multiple of num_key_value_heads "
                             f"({kv_heads!r}): each KV head serves the same number of query heads.")
        inter = _required(cfg, "intermediate_size")
        max_positions = cfg.get("max_position_embeddings", absent.get("max_position_embeddings", 2048))
        for key, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("vocab_size", vocab),
                           ("intermediate_size", inter), ("max_position_embeddings", max_positions)):
            check_int(key, value, 1)
        for key in ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "qkv_bias"):
            if not isinstance(cfg.get(key, False), bool):
                raise ValueError(f"{key} must be true or false, got {cfg[key]!r}.")
        if (opt or neox) and cfg.get("head_dim") is None and hidden % heads:   # (heads hidden_size / heads wide)
            raise ValueError(f"{_key(arch, 'hidden_size')} ({hidden}) must be divisible by "
                             f"{_key(arch, 'num_attention_heads')} ({heads}) for {arch}.")
        eps = cfg.get("rms_norm_eps", absent.get("rms_norm_eps", 1e-6))
        if not (is_number(eps) and 0 <= eps <= FLOAT32_MAX):
            raise ValueError(f"rms_norm_eps must be a finite number >= 0, got {eps!r}.")
        head_dim = cfg.get("head_dim", absent.get("head_dim"))
        head_dim = hidden // heads if head_dim is None else head_dim
        if not (is_int(head_dim) and head_dim > 0):
            raise ValueError(f"head_dim must be a positive integer (or null: hidden_size / num_attention_heads), "
                             f"got {head_dim!r}.")
        if head_dim % 2 and opt is None:   # (OPT rotates nothing)
            raise ValueError(f"head_dim must be even (the rotary embedding turns pairs of dimensions), got {head_dim}.")
        scalar = cfg.get("query_pre_attn_scalar")
        scalar = 256 if scalar is None else scalar   # (transformers' Gemma default)
        if gemma and not is_float32_scale(scalar):
            raise ValueError(f"query_pre_attn_scalar must be a positive number (or null: 256), got {scalar!r}.")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if not isinstance(eos, list) else list(eos))
        bos = cfg.get("bos_token_id")
        if not all(_token_id(t) for t in eos_ids) or not (bos is None or _token_id(bos)):
            raise ValueError(f"eos_token_id ({eos!r}) and bos_token_id ({bos!r}) must be token ids (integers >= 0), "
                             "eos_token_id also a list of them, or null.")
        unrotated = nope_layers(cfg, layers) if arch == "SmolLM3ForCausalLM" else ()
        sliding, windowed = read_windows(arch, cfg, layers, unrotated)
        granite = _granite_scalars(cfg) if arch == "GraniteForCausalLM" else {}
        moe = read_moe(cfg, arch, layers, inter)
        check_int("sliding_window", sliding, 1, optional=True)
        rope = read_rope(cfg, arch, head_dim, max_positions)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=eps,
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            rotary_dim=rope.rotary_dim,
            unrotated_layers=unrotated,
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", absent.get("tie_word_embeddings", family)),
            # (transformers' Qwen2 always has q/k/v biases and Mistral never: their attention_bias is ignored)
            attention_bias=(cfg.get("attention_bias", False) if arch in _CONFIGURED_BIAS
                            else cfg.get("qkv_bias", True) if arch == "Qwen2MoeForCausalLM"
                            else SUPPORTED_ARCHITECTURES[arch]),
            o_proj_bias=bool(cfg.get("vllm_spec_o_proj_bias",
                                     arch in _CONFIGURED_BIAS and cfg.get("attention_bias", False))),
            mlp_bias=cfg.get("mlp_bias", False) if arch in _MLP_BIAS else False,
            moe=moe,
            opt=opt,
            neox=neox,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
            or (arch == "PhiForCausalLM" and cfg.get("qk_layernorm", False)),
            hidden_act=ACTIVATIONS[act],
            embed_scale=family,
            norm_unit_offset=family,
            sandwich_norms=gemma,
            attention_scale=float(scalar) ** -0.5 if gemma else granite.get("attention_multiplier"),
            local_rope_theta=rope.local_theta,
            final_logit_softcapping=softcap,
            attn_logit_softcapping=attn_softcap,
            embedding_multiplier=granite.get("embedding_multiplier", 1.0),
            residual_multiplier=granite.get("residual_multiplier", 1.0),
            logits_scaling=granite.get("logits_scaling", 1.0),
            sliding_window=sliding,
            windowed_layers=windowed,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            embeddings_from_target=bool(cfg.get("vllm_spec_embeddings_from_target", False)),
            draft_vocab=_draft_vocab(cfg.get("vllm_spec_draft_vocab"), vocab),
            cpu_weights=_cpu_weights(cfg.get("vllm_spec_cpu_weights")),
        )


def _softcap(cfg: dict[str, Any], key: str, arch: str, default: float | None) -> float | None:
    """A Gemma soft cap: null or a positive number (absent: transformers' default); other models have none."""
    value = cfg.get(key, default)
    if value is None:
        return None
    if arch not in _GEMMA:
        raise ValueError(f"{key} ({value!r}) is not supported for {arch}: it must be null (Gemma's soft caps).")
    if not is_float32_scale(value):
        raise ValueError(f"{key} ({value!r}) is not supported: it must be null or a finite positive number.")
    return float(value)


def _draft_vocab(value: Any, vocab_size: int) -> tuple[int, ...] | None:
    """"vllm_spec_draft_vocab": N (token ids 0..N-1, BPE ids come roughly by frequency) or a list of ids."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        ids = tuple(range(value))
    elif isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        ids = tuple(sorted(set(value)))
    else:
        raise ValueError("vllm_spec_draft_vocab must be an integer or a list of token ids, "
                         f"got {type(value).__name__}.")
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"vllm_spec_draft_vocab must name token ids in [0, {vocab_size}) (at least one).")
    return ids


def _cpu_weights(value: Any) -> str | None:
    """"vllm_spec_cpu_weights": null or "q8_0"."""
    if value is not None and value not in CPU_WEIGHT_FORMATS:
        raise ValueError(f"vllm_spec_cpu_weights must be one of {CPU_WEIGHT_FORMATS} or null, got {value!r}.")
    return value


def _granite_scalars(cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's four scalars, each a finite positive number (absent or null: 1)."""
    out = {}
    for key in _GRANITE_SCALARS:
        value = cfg.get(key)
        value = 1.0 if value is None else value
        if not is_float32_scale(value):
            raise ValueError(f"{key} must be a finite positive number (or null: 1), got {value!r}.")
        out[key] = float(value)
    return out


def _key(arch: str, name: str) -> str:
    return _CONFIG_KEYS.get(arch, {}).get(name, name)


def _token_id(value: Any) -> bool:
    return is_int(value) and value >= 0


def _required(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"The model config (config.json) has no {key!r}: it is required for {cfg.get('architectures')}.")
    return cfg[key]
