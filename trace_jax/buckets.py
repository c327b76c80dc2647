"""Shape buckets: pad a size up to one of a few values so a run compiles a handful of programs, not one per size.

Every padded shape in the package (train-batch rows and lengths, engine prefill / extend / slot counts,
predictor batches) goes through these helpers, so "which sizes compile" is decided in one place.
"""

from __future__ import annotations

from collections.abc import Sequence


def bucket(n: int, buckets: Sequence[int], what: str = "size") -> int:
    """The smallest of ``buckets`` (ascending) that is >= ``n``.

    Raises ValueError, naming ``what``, when ``n`` is larger than the largest bucket.
    """
    if not buckets:
        raise ValueError(f"no buckets given for {what} {n}")
    for b in buckets:
        if b >= n:
            return int(b)
    raise ValueError(f"{what} {n} is larger than the largest bucket {buckets[-1]}; add a larger bucket")


def power_of_two(n: int, minimum: int = 1, maximum: int | None = None, what: str = "size") -> int:
    """The smallest power of two >= ``max(n, minimum)``, capped at ``maximum``.

    Raises ValueError, naming ``what``, when ``n > maximum`` (a cap that is not a power of two is itself a bucket).
    """
    if maximum is not None and n > maximum:
        raise ValueError(f"{what} {n} is larger than the maximum {maximum}; raise the maximum")
    size = 1 << (max(n, minimum, 1) - 1).bit_length()
    return size if maximum is None else min(size, maximum)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-n // multiple) * multiple
