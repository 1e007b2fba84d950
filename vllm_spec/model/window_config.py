"""A config's sliding-window attention (which layers attend within how many tokens) and SmolLM3's layers without a
rotary embedding, read as transformers reads them for each architecture."""

from __future__ import annotations

from typing import Any

from vllm_spec.utils import check_int, is_int

# transformers' sliding_window for a config.json without one: Mistral's, Gemma's, and Qwen2's with use_sliding_window.
_SLIDING_WINDOW_DEFAULT = 4096
# The architectures whose configs can window attention (the others ignore a sliding_window key).
_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
             "SmolLM3ForCausalLM")


def read_windows(arch: str, cfg: dict[str, Any], layers: int,
                 unrotated: tuple[int, ...]) -> tuple[int | None, tuple[int, ...] | None]:
    """(window, the layers it applies to: None for all), as transformers reads the config: the families outside
    _WINDOWED have none (a sliding_window key is ignored); Mistral windows every layer (4096 unless the key says
    otherwise, null: none), or those its layer_types call sliding (Ministral); Qwen2 and Qwen3 only with
    use_sliding_window, on the layers layer_types call sliding, else from max_window_layers on (Qwen3-MoE: on every
    layer; Qwen2-MoE: the even layers below max_window_layers); Phi-3 and Mixtral every layer where the key is set;
    Gemma 2 and 3 the layers their layer_types call sliding, else all but every sliding_window_pattern-th (Gemma 2:
    every other one); SmolLM3 (with a window) the layers layer_types call sliding, else with use_sliding_window its
    NoPE layers."""
    if arch not in _WINDOWED:
        return None, None
    if arch in ("Phi3ForCausalLM", "MixtralForCausalLM"):   # every layer, where the key is set
        return cfg.get("sliding_window"), None
    if arch == "Qwen3MoeForCausalLM":   # every layer, with use_sliding_window
        return (cfg.get("sliding_window", _SLIDING_WINDOW_DEFAULT), None) if cfg.get("use_sliding_window") \
            else (None, None)
    typed = _sliding_layers(cfg, layers)   # (those layer_types call sliding; None: no layer_types)
    if arch == "SmolLM3ForCausalLM":   # (layer_types as transformers' masks read them, use_sliding_window or not)
        window = cfg.get("sliding_window")
        if window is None or not (typed is not None or cfg.get("use_sliding_window", False)):
            return None, None
        return window, unrotated if typed is None else typed
    sliding = cfg.get("sliding_window", _SLIDING_WINDOW_DEFAULT)
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        if typed is None:   # every sliding_window_pattern-th layer attends to everything
            pattern = 2 if arch == "Gemma2ForCausalLM" else \
                cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
            check_int("sliding_window_pattern", pattern, 1)
            typed = tuple(i for i in range(layers) if (i + 1) % pattern)
        return sliding, typed
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        if not cfg.get("use_sliding_window", False):
            return None, None
        if typed is None and arch == "Qwen2MoeForCausalLM":   # (transformers' rule: the even layers below it)
            typed = tuple(i for i in range(min(layers, _max_window_layers(cfg))) if i % 2 == 0)
        elif typed is None:
            typed = tuple(range(_max_window_layers(cfg), layers))
    return sliding, typed


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...] | None:
    """The layers layer_types calls "sliding_attention" (None without layer_types), checked as transformers checks
    it: one "sliding_attention" or "full_attention" a layer."""
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not (isinstance(types, list) and len(types) == layers
            and all(t in ("sliding_attention", "full_attention") for t in types)):
        raise ValueError(f"layer_types must be a list of {layers} entries (one a layer), each 'sliding_attention' "
                         f"or 'full_attention', got {types!r}.")
    return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def nope_layers(cfg: dict[str, Any], layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without a rotary embedding: those no_rope_layers marks 0, else every
    no_rope_layer_interval-th (transformers' default: 4)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = cfg.get("no_rope_layer_interval", 4)
        check_int("no_rope_layer_interval", interval, 1)
        return tuple(i for i in range(layers) if (i + 1) % interval == 0)
    if not (isinstance(flags, list) and len(flags) >= layers and all(is_int(f) and f in (0, 1) for f in flags)):
        raise ValueError(f"no_rope_layers must be a list of at least {layers} flags (one a layer; 1: the layer "
                         f"rotates, 0: it does not), got {flags!r}.")
    return tuple(i for i, f in enumerate(flags[:layers]) if not f)


def _max_window_layers(cfg: dict[str, Any]) -> int:
    value = cfg.get("max_window_layers", 28)   # (transformers' default)
    check_int("max_window_layers", value, 0)
    return value
