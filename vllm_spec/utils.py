"""Small helpers shared across layers."""

from __future__ import annotations


def concat_slice(first: list[int], second: list[int], start: int, stop: int) -> list[int]:
    """(first + second)[start:stop] without building the concatenation."""
    n = len(first)
    if stop <= n:
        return first[start:stop]
    if start >= n:
        return second[start - n: stop - n]
    return first[start:] + second[: stop - n]
