"""Hands memory the process has freed back to the operating system.

glibc's allocator keeps freed heap pages for reuse. A training step frees gigabytes of temporaries of many
sizes (rollout buffers, logits, XLA compilation scratch), so without this the resident size keeps every
step's high-water mark and grows with fragmentation (the default run's phases, resident and live:
docs/benchmarks.md, "Memory of the default run", ``python -m trace_jax.bench.memory``). Calling :func:`release`
between phases keeps the resident size near what is live. A no-op where glibc's ``malloc_trim`` is not available.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def release() -> None:
    """Collects garbage, then returns the allocator's free pages to the OS (glibc ``malloc_trim(0)``)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
