"""Small helpers shared across layers."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
import torch

T = TypeVar("T")


def is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool (True is an int to isinstance)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_unset(value: object) -> bool:
    """None or an empty list or dict: the neutral value of a vLLM option this engine does not implement."""
    return value is None or (isinstance(value, (list, dict)) and not value)


def is_number(value: object) -> bool:
    """A real number, not a bool (checked before comparisons, so a wrong type is a ValueError too)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


FLOAT32_MAX = 3.4028234663852886e38
# The least normal float32: below it a scale rounds to 0 (its inverse to inf).
_FLOAT32_TINY = 1.1754943508222875e-38


def is_float32_scale(value: object) -> bool:
    """A positive number float32 holds as a normal one (its inverse too): a model's scale or factor."""
    return is_number(value) and _FLOAT32_TINY <= value <= FLOAT32_MAX


def check_int(name: str, value: object, minimum: int, optional: bool = False) -> None:
    """ValueError naming the field unless value is an integer >= minimum (or None, if optional): a
    float or a bool would be taken for one and fail far from where it was given."""
    if not ((optional and value is None) or (is_int(value) and value >= minimum)):
        allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}.")


def check_text(name: str, value: object) -> None:
    """ValueError naming the field where text (in value, or in the lists and dicts it holds) has a
    lone surrogate: valid JSON ("\\ud800") and a Python str, but no Unicode text that tokenizers take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} is not valid Unicode text: a lone surrogate ({value[e.start]!r}) at "
                             f"position {e.start}.") from None
    elif isinstance(value, (list, tuple)):
        if value and isinstance(value[0], numbers.Number):
            return   # token ids (lists are of one kind): no text, and possibly 100k of them
        for item in value:
            check_text(name, item)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(name, key)
            check_text(name, item)


def concat_slice(first: list[int], second: list[int], start: int, stop: int) -> list[int]:
    """(first + second)[start:stop] without building the concatenation."""
    n = len(first)
    if stop <= n:
        return first[start:stop]
    if start >= n:
        return second[start - n: stop - n]
    return first[start:] + second[: stop - n]


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host list as a device tensor, queued behind the device's work instead of waiting for it.

    torch.tensor(values, device="cuda") copies synchronously: the host blocks until every kernel
    already queued has run, and the device then idles while the host catches up. Mid-step index
    tensors go through here instead.
    """
    np_dtype = _NUMPY_DTYPES.get(dtype)
    # numpy converts a list several times faster than torch.tensor (256 floats: ~8 against ~35 us);
    # np.array copies, so the tensor never aliases the caller's array (a CPU .to() is no copy).
    host = torch.tensor(values, dtype=dtype) if np_dtype is None else torch.from_numpy(np.array(values, dtype=np_dtype))
    return host.to(device, non_blocking=True)


_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
                 torch.bool: np.bool_}


class KeptForIds(Generic[T]):
    """A value built for a list of sequence ids, served again while exactly those ids come back in that
    order: for values that depend on the sequences' fixed fields alone (parameters, generators; ids are
    never reused), which a steady batch then builds once, not every step."""

    def __init__(self):
        self._kept: tuple[list[int], T] | None = None

    def get(self, seq_ids: list[int], build: Callable[[], T]) -> T:
        """The kept value when it was built for exactly `seq_ids`, else build()'s (kept where `keeps`)."""
        if self._kept is not None and self._kept[0] == seq_ids:
            return self._kept[1]
        value = build()
        self._kept = (seq_ids, value) if self.keeps(value) else None
        return value

    def keeps(self, value: T) -> bool:
        """Whether a built value may serve later steps."""
        return True
