"""Safetensors read by byte range from a local folder or a bucket (``gs://``), so each host reads only its share.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``, ``shape``,
``data_offsets`` relative to the end of the header) and the raw row-major data. ``CheckpointFiles`` parses the
headers of a Hugging Face checkpoint's files (one file, or the shards its ``model.safetensors.index.json`` names)
and ``rows`` reads one contiguous block of a tensor's leading-axis rows: one ranged request, never the whole file.
Local paths and URLs go through the same fsspec filesystem calls (``cat_file(path, start, end)``);
``bytes_read`` counts the tensor bytes asked for, which is what a host holds transiently.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import posixpath

import fsspec
import ml_dtypes
import numpy as np

from trace_jax import paths

ST_DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
}
INDEX_FILE = "model.safetensors.index.json"


def filesystem(path: str | os.PathLike) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of a local path or an object-store URL, and the path in its terms."""
    return fsspec.core.url_to_fs(os.fspath(paths.as_path(path)))


def read_bytes(path: str | os.PathLike) -> bytes:
    """A whole (small) file, local or ``gs://``."""
    fs, inner = filesystem(path)
    return fs.cat_file(inner)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in its file: absolute byte offsets ``[start, end)``."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def _header(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, TensorEntry]:
    length = int.from_bytes(fs.cat_file(path, 0, 8), "little")
    header = json.loads(fs.cat_file(path, 8, 8 + length))
    header.pop("__metadata__", None)
    entries = {}
    for name, entry in header.items():
        if entry["dtype"] not in ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        dtype, shape = ST_DTYPES[entry["dtype"]], tuple(entry["shape"])
        if not shape:
            raise ValueError(f"{path}: tensor {name!r} is a scalar; checkpoint weights have at least one axis")
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(
                f"{path}: tensor {name!r} spans {end - start} bytes; its shape {shape} needs "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        entries[name] = TensorEntry(path, dtype, shape, 8 + length + start, 8 + length + end)
    return entries


class CheckpointFiles:
    """The tensors of a HF checkpoint directory (local or a URL), read row block by row block on demand."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = os.fspath(hf_dir)
        self._fs, root = filesystem(hf_dir)
        index = posixpath.join(root, INDEX_FILE)
        if self._fs.isfile(index):
            weight_map = json.loads(self._fs.cat_file(index))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(posixpath.basename(p) for p in self._fs.ls(root, detail=False) if p.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {self.hf_dir} (and no {INDEX_FILE})")
        self.entries: dict[str, TensorEntry] = {}
        for name in files:
            path = posixpath.join(root, name)
            if not self._fs.isfile(path):
                raise FileNotFoundError(f"{INDEX_FILE} names shard {name}, which is missing from {self.hf_dir}")
            self.entries.update(_header(self._fs, path))
        self.bytes_read = 0
        # Blocks read since ``forget``: a tensor sharded along its columns needs the same rows on each local device.
        self._blocks: dict[str, tuple[int, int, np.ndarray]] = {}

    def forget(self) -> None:
        """Drops the blocks kept for reuse (call once a parameter's shards are all placed)."""
        self._blocks = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def rows(self, name: str, first: int, stop: int) -> np.ndarray:
        """Rows ``[first, stop)`` of tensor ``name`` along its leading axis,
        read with one ranged request unless a block kept since ``forget`` holds them; shape
        ``(stop - first, *shape[1:])``."""
        kept = self._blocks.get(name)
        if kept and kept[0] <= first and stop <= kept[1]:
            return kept[2][first - kept[0] : stop - kept[0]]
        entry = self.entries[name]
        inner = entry.shape[1:]
        row_bytes = math.prod(inner) * entry.dtype.itemsize
        start = entry.start + first * row_bytes
        raw = self._fs.cat_file(entry.file, start, entry.start + stop * row_bytes)
        self.bytes_read += len(raw)
        block = np.frombuffer(raw, entry.dtype).reshape(stop - first, *inner)
        self._blocks[name] = (first, stop, block)
        return block
