"""Run directories that may be local or in a bucket: one path type (``etils.epath``) from the flag to orbax.

``pathlib.Path("gs://bucket/run")`` is ``gs:/bucket/run``: a local folder named ``gs:`` on every host, and
checkpoints that never reach the bucket. Everything that takes a workdir or a checkpoint directory goes
through ``as_path`` instead, which keeps ``gs://`` (and ``s3://``, ``az://``, ``hf://``) a URL end to end —
the same ``epath.Path`` orbax itself uses — and makes local paths absolute (orbax requires that).

Object stores have no append and no rename of a directory in one step; the helpers here say what they do
on each kind of path so callers need not branch:

    workdir = as_path(flags.workdir)                   # "gs://b/run" stays a URL; "runs/x" -> /abs/runs/x
    (workdir / "summary.json").write_text(text)        # epath: works on both
    append_text(workdir / "metrics.jsonl", line)       # local: a real append; bucket: rewrite the object
    copy_tree(local_tokenizer_dir, workdir / "tokenizer")
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import tempfile

from etils import epath

# The schemes epath sends to an object store (gs: GCS through tf.io.gfile or fsspec/gcsfs; orbax's arrays
# go through tensorstore's own GCS driver).
URL_SCHEMES = ("gs://", "s3://", "az://", "hf://")


def is_url(path: str | os.PathLike) -> bool:
    """True for an object-store URL such as ``gs://bucket/run``."""
    return os.fspath(path).startswith(URL_SCHEMES)


def as_path(path: str | os.PathLike) -> epath.Path:
    """``path`` as an ``epath.Path``: a URL stays a URL, a local path becomes absolute (``~`` expanded).

    Raises ValueError for a URL whose ``//`` was already collapsed by ``pathlib`` (``gs:/bucket``), which
    would otherwise be written to a local folder named ``gs:``, and for schemes epath cannot open.
    """
    text = os.fspath(path)
    if is_url(text):
        return epath.Path(text)
    scheme = text.split(":", 1)[0] + "://" if ":" in text else ""
    if scheme in URL_SCHEMES:
        raise ValueError(
            f"{text!r} looks like a {scheme} URL whose '//' was collapsed (pathlib.Path does that); "
            "pass the URL as a string or an epath.Path"
        )
    if "://" in text:
        raise ValueError(f"{text!r}: unsupported URL scheme; use a local path or one of {', '.join(URL_SCHEMES)}")
    return epath.Path(text).expanduser().absolute()


def process_local_dir(url: str | os.PathLike, purpose: str) -> epath.Path:
    """A folder of this process under the system's temporary directory for local copies of ``url``'s files (one
    per URL and ``purpose``; created, possibly holding an earlier copy). For libraries that read only local
    files; the process id in its name keeps two processes of one host from writing each other's copies."""
    digest = hashlib.sha256(os.fspath(url).encode()).hexdigest()[:16]
    local = epath.Path(tempfile.gettempdir()) / f"trace_jax_{purpose}_{os.getpid()}" / digest
    local.mkdir(parents=True, exist_ok=True)
    return local


def _without_scheme(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return text.split("://", 1)[1] if is_url(text) else text


def append_text(path: str | os.PathLike, text: str) -> None:
    """Appends ``text`` to a file, creating it (and its folder) if needed.

    Local files get a real append (one write call, so a kill leaves whole lines). Object stores cannot
    append: the object is read and written back whole, which is fine for logs of a few MB (one
    ``metrics.jsonl`` line per step) and wrong for anything large.
    """
    path = as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not is_url(path):
        with open(path, "a") as f:
            f.write(text)
        return
    old = path.read_text() if path.exists() else ""
    path.write_text(old + text)


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copies the files under ``src`` into ``dst`` (either may be local or a URL), replacing same names.

    For libraries that only read and write local folders (tokenizers, matplotlib): write locally, then copy.
    """
    src, dst = as_path(src), as_path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    root = _without_scheme(src)
    for dirpath, _, filenames in src.walk():  # epath refuses rglob("**") on object stores
        # fsspec stores report walked folders without their scheme ("bucket/run/x"): relate by text.
        relative = posixpath.relpath(_without_scheme(dirpath), root)
        folder = src if relative == "." else src / relative
        target = dst if relative == "." else dst / relative
        target.mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (folder / name).copy(target / name, overwrite=True)


class LocalMirror:
    """A local folder for files that libraries can only write locally (logs, TensorBoard events, plots), kept
    in step with a run directory that may be a bucket.

    For a local ``remote`` the mirror *is* ``remote`` and ``pull`` / ``push`` do nothing. For a URL the files
    live in ``local`` (a folder under the system's temporary directory, one per URL); ``pull`` first copies
    down what the bucket already holds (a resumed run appends to its logs), ``push`` copies everything up
    (call it after each logged step: the files are small).
    """

    def __init__(self, remote: str | os.PathLike, local: str | os.PathLike | None = None):
        self.remote = as_path(remote)
        if not is_url(self.remote):
            self.local = self.remote
            return
        if local is None:
            digest = hashlib.sha256(os.fspath(self.remote).encode()).hexdigest()[:16]
            local = os.path.join(tempfile.gettempdir(), "trace_jax_mirror", digest)
        self.local = as_path(local)
        self.local.mkdir(parents=True, exist_ok=True)

    @property
    def mirrored(self) -> bool:
        return self.local != self.remote

    def pull(self, names: tuple[str, ...]) -> None:
        """Replaces the local copies of ``names`` (files or folders under the run directory) by the bucket's."""
        if not self.mirrored:
            return
        for name in names:
            src, dst = self.remote / name, self.local / name
            if src.is_dir():
                copy_tree(src, dst)
            elif src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                src.copy(dst, overwrite=True)

    def push(self) -> None:
        """Copies every local file up to the run directory (a no-op for a local run directory)."""
        if self.mirrored:
            copy_tree(self.local, self.remote)
