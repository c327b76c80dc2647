"""Freed heap memory goes back to the OS on ``heap.release()`` (glibc)."""

import pathlib

import pytest

from trace_jax.job import heap


def rss_mib():
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise KeyError("VmRSS")


@pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_release_returns_freed_heap_pages():
    heap.release()
    blocks = [bytearray(48 * 1024) for _ in range(4000)]  # ~190 MiB of mid-size blocks: heap, not mmap
    live = blocks[1::2]  # every other block stays: the freed ones are holes the allocator keeps
    del blocks
    kept = rss_mib()
    heap.release()
    released = kept - rss_mib()
    assert released > 60, f"only {released:.0f} MiB of ~95 MiB of freed blocks went back to the OS"
    assert len(live) == 2000  # still allocated: only the holes were handed back
