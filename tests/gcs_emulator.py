"""A real GCS JSON API on 127.0.0.1 for tests: the real clients (gcsfs behind epath, google-cloud-storage, tensorstore's
``gcs`` kvstore behind orbax) talk HTTP to a local emulator, so a test exercises exactly what a pod's hosts run.

Each client finds the emulator through its own environment variable; :func:`emulator_env` lists them, and
:func:`gcs_emulator` sets them in this process (for in-process clients) and hands them back for subprocesses::

    with gcs_emulator("bucket") as gcs:
        epath.Path("gs://bucket/x").write_text("hi")
        subprocess.run([...], env={**os.environ, **gcs.env})

The emulator keeps objects in memory and is stopped (and the variables restored) when the block ends. Nothing
leaves the loopback interface.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Iterator

# gcsfs probes each bucket's kind over gRPC before its first call, which an emulator never answers (a 60 s wait);
# the variable must be set before gcsfs is imported, so it is set when this module is.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@dataclasses.dataclass(frozen=True)
class Emulator:
    """A running emulator: its URL and the environment that points every client at it."""

    url: str
    bucket: str
    env: dict[str, str]

    def gs(self, *parts: str) -> str:
        """The ``gs://`` URL of ``parts`` joined under the default bucket."""
        return "/".join([f"gs://{self.bucket}", *(p.strip("/") for p in parts)])


def emulator_env(url: str) -> dict[str, str]:
    """The variables that send gcsfs / google-cloud-storage and tensorstore to ``url`` without credentials."""
    return {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs, google-cloud-storage
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore's gcs kvstore (orbax's arrays)
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "GCE_METADATA_HOST": "127.0.0.1:9",  # no metadata server: fail fast instead of probing the network
        "GCE_METADATA_IP": "127.0.0.1:9",
        "NO_GCE_CHECK": "True",
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _forget_clients() -> None:
    """fsspec caches a gcsfs client per set of arguments, with the endpoint it read at construction: drop them so the
    next client reads the current one."""
    import gcsfs  # test-only dependency (the `gcs` extra), kept off the package's path

    gcsfs.GCSFileSystem.clear_instance_cache()


@contextlib.contextmanager
def gcs_emulator(bucket: str = "bucket") -> Iterator[Emulator]:
    """Starts an in-memory GCS emulator on a free loopback port with ``bucket`` created; sets its variables here."""
    from gcp_storage_emulator.server import create_server  # test-only dependency, kept off the package's path

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = emulator_env(url)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _forget_clients()
    try:
        yield Emulator(url=url, bucket=bucket, env=env)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_clients()
        server.stop()
