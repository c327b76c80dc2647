"""A fake ``gs://`` for tests: every layer sees the URL, only the last hop writes to a local folder.

Three things talk to GCS on a real run, and each is replaced at its transport, not above it:

- epath (workdir files, orbax's step directories and metadata) goes through fsspec's ``gs`` protocol:
  ``FakeGCS`` serves it from ``root/<bucket>/<path>``;
- orbax asks the bucket whether it has a hierarchical namespace (the GCS JSON API): the fake says no;
- orbax's arrays go through tensorstore's ``gcs`` kvstore: the fake hands tensorstore a ``file`` kvstore
  at the same local place.

Nothing goes over the network. ``with fake_gcs(tmp_path / "gcs") as root: ...``
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import fsspec
from etils.epath import backend as epath_backend
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry
from orbax.checkpoint._src.path import gcs_utils


class FakeGCS(LocalFileSystem):
    """fsspec ``gs``/``gcs`` protocol on a local folder; paths it returns are ``bucket/key`` like gcsfs's."""

    protocol = ("gs", "gcs")
    root = ""  # set by fake_gcs()

    def __init__(self, *args, finalize_on_close=None, **kwargs):  # epath passes a GCS-only option
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        if path.startswith(cls.root):
            return path.rstrip("/")
        for prefix in ("gs://", "gcs://"):
            path = path.removeprefix(prefix)
        return f"{cls.root}/{path.strip('/')}".rstrip("/")

    @classmethod
    def _to_key(cls, path: str) -> str:
        return path[len(cls.root) + 1 :] if path.startswith(cls.root + "/") else path

    def glob(self, path, **kwargs):
        return [self._to_key(p) for p in super().glob(path, **kwargs)]

    def walk(self, path, *args, **kwargs):
        for dirpath, dirs, files in super().walk(path, *args, **kwargs):
            yield self._to_key(dirpath), dirs, files


def _kvstore_for_local_bucket(ckpt_path: str) -> dict:
    bucket, key = gcs_utils.parse_gcs_path(ckpt_path, add_trailing_slash=False)
    return {"driver": "file", "path": f"{FakeGCS.root}/{bucket}/{key}"}


@contextlib.contextmanager
def fake_gcs(root: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Routes ``gs://bucket/key`` to ``root/bucket/key`` for the duration (see the module docstring)."""
    root = pathlib.Path(root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    saved_registry = {name: _registry.get(name) for name in ("gs", "gcs")}
    saved_orbax = (gcs_utils.is_hierarchical_namespace_enabled, gcs_utils.get_kvstore_for_gcs)
    FakeGCS.root = str(root)
    FakeGCS.clear_instance_cache()
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, FakeGCS, clobber=True)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    gcs_utils.is_hierarchical_namespace_enabled = lambda path: False
    gcs_utils.get_kvstore_for_gcs = _kvstore_for_local_bucket
    try:
        yield root
    finally:
        gcs_utils.is_hierarchical_namespace_enabled, gcs_utils.get_kvstore_for_gcs = saved_orbax
        for name, cls in saved_registry.items():
            if cls is None:
                _registry.pop(name, None)  # fsspec has no public way to unregister
            else:
                fsspec.register_implementation(name, cls, clobber=True)
        epath_backend.fsspec_backend._get_filesystem.cache_clear()
        FakeGCS.clear_instance_cache()
