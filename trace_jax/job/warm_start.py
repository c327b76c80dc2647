"""A shared cache of warm starts (tokenizer + SFT policy), keyed by everything that determines them.

Two runs whose world, tokenizer, ReAct, retriever and SFT settings agree get the same warm start, so it is trained once
and every later run (an ablation, a rerun in a fresh workdir, ``trace_jax.evaluate``) reuses it; ablations of
one recipe therefore start RL from the very same model. The key is a hash of those config sections, the
format version below, the jax version (numerics may change between versions) and the code that computes a
warm start (:data:`CODE`, read as syntax trees: a comment, a docstring or a reformatting keeps the key; any
other edit trains a new warm start, so an edited SFT loop, world, tokenizer, renderer or model is never
served a stale one); the run's seed for RL, its allocation policy, optimizer and so on are not part of it.

Layout under ``cache_dir`` (default ``~/.cache/trace_jax/warm_start``; a local folder or a bucket, ``gs://...``)::

    <key>/tokenizer/       the world's BPE (a HF tokenizer directory)
    <key>/sft/             orbax checkpoint of the SFT params (``trace_jax.job.sft.run_sft``)
    <key>/warm_start.json  what was trained and how (written last: its presence means complete)
    <key>.lock             local cache only: held while one run builds the entry; concurrent runs wait for it

    entry = WarmStartCache(cache_dir).entry(config)
    with entry.building():          # exclusive; returns at once when nobody else builds it
        ...train into entry.directory (the tokenizer into entry.local)...
        entry.write_info({...})

In a bucket (several hosts, no shared filesystem) the HF tokenizer library still reads and writes only local
files, so each process keeps the tokenizer in a folder of its own (``entry.local``): process 0 alone trains it
there and uploads it (``publish_tokenizer``); every process that reads it downloads it (``fetch_tokenizer``),
from a complete entry or, within one job, after process 0 published it. The SFT checkpoint is written to the
bucket by orbax itself (its steps are committed whole), and process 0 writes ``warm_start.json`` last. A bucket
has no locks: two jobs that build the same key at the same time both train it, so start one job first and the
others once its warm start is complete.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import pathlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from etils import epath

from trace_jax import paths
from trace_jax.configs import RunConfig
from trace_jax.configs.sections import WarmStartConfig  # noqa: F401  (re-exported: where it used to live)

# Bump when something outside CODE changes what a given config trains into (a dependency's behaviour, the
# cache layout); changes to CODE move the key by themselves.
FORMAT_VERSION = 1
# The modules (paths under trace_jax/; a directory: its modules) whose code decides a warm start's numbers: the
# world and its questions, the BPE tokenizer's training, the ReAct rendering of demonstrations and the BM25
# retriever whose results they quote, the model, the optimizer and the SFT loop. Left out on purpose: code that
# only moves the same numbers around (checkpoint I/O, paths, registries, config plumbing, device placement of
# a one-device run, the HTTP retriever client/server, which the synthetic recipe does not use); an edit there
# retrains nothing. Code left out that does change the numbers needs a FORMAT_VERSION bump.
CODE = (
    "job/sft.py",
    "configs/sections.py",  # SFTConfig.model_config: the policy's architecture
    "data/synthetic.py",
    "data/tokenizer.py",
    "envs/react.py",
    "envs/stops.py",
    "envs/retrieval/retriever.py",
    "envs/retrieval/bm25.py",
    "models",
    "optim.py",
)
# The config sections a warm start depends on; anything else (RL, allocation, eval, ...) is not in the key.
KEY_SECTIONS = ("world", "tokenizer", "react", "retriever", "sft")
INFO_FILE = "warm_start.json"


def key_material(config: RunConfig) -> dict[str, Any]:
    """The JSON-able values the warm start depends on (the hashed input of :func:`fingerprint`): the
    :data:`KEY_SECTIONS` of the run's config as dicts of their fields, the format and jax versions, the code."""
    sections = {name: dataclasses.asdict(getattr(config, name)) for name in KEY_SECTIONS}
    return {"format_version": FORMAT_VERSION, "jax": jax.__version__, "code": code_digest(), **sections}


def _code_files() -> list[pathlib.Path]:
    package = pathlib.Path(__file__).resolve().parents[1]
    files = []
    for name in CODE:
        path = package / name
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return files


def _syntax(source: str) -> str:
    """The module's syntax tree without docstrings (comments and layout are not in it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.cache
def code_digest() -> str:
    """A 16-hex-digit digest of the syntax trees of :data:`CODE`'s modules (the code that trains a warm start)."""
    digest = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parents[1]
    for path in _code_files():
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + _syntax(path.read_text()).encode())
    return digest.hexdigest()[:16]


def fingerprint(config: RunConfig) -> str:
    """A 16-hex-digit key of :func:`key_material` (sorted-key JSON, sha256)."""
    text = json.dumps(key_material(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One warm start's place in the cache.

    directory: where the entry lives: a local folder, or a bucket's (an ``epath.Path`` URL).
    local: the local folder whose ``tokenizer/`` the world is built from: ``directory`` itself for a local
      cache, a folder of this process for a bucket (see the module docstring).
    """

    key: str
    directory: pathlib.Path | epath.Path
    local: pathlib.Path

    @property
    def in_bucket(self) -> bool:
        return paths.is_url(self.directory)

    @property
    def info_path(self) -> pathlib.Path | epath.Path:
        return self.directory / INFO_FILE

    def info(self) -> dict[str, Any] | None:
        """The recorded description of a complete entry, or None while it is missing or being built."""
        if not self.info_path.is_file():
            return None
        try:
            return json.loads(self.info_path.read_text())
        except json.JSONDecodeError:  # torn by a kill mid-write: treat the entry as unfinished
            return None

    def write_info(self, info: Mapping[str, Any]) -> None:
        """Records ``info`` atomically (a bucket's object is written whole; a local file is written aside, then
        renamed): the entry is complete."""
        text = json.dumps(dict(info), indent=2, sort_keys=True) + "\n"
        if self.in_bucket:
            self.info_path.write_text(text)
            return
        tmp = self.info_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.info_path)

    def publish_tokenizer(self) -> None:
        """Bucket: uploads the tokenizer trained in ``local`` (process 0 alone, before ``write_info``). Local: nothing
        to do (``local`` is the entry)."""
        if self.in_bucket:
            paths.copy_tree(self.local / "tokenizer", self.directory / "tokenizer")

    def fetch_tokenizer(self) -> None:
        """Bucket: downloads the entry's tokenizer into ``local`` (only once it is whole: from a complete entry, or
        after process 0 published it). Local: nothing to do."""
        if self.in_bucket:
            paths.copy_tree(self.directory / "tokenizer", self.local / "tokenizer")

    @contextlib.contextmanager
    def building(self, notify: Any = None) -> Iterator[CacheEntry]:
        """Exclusive access to a local entry while it is checked and, if needed, built.

        Another process building the same key makes this wait (``notify(message)`` is called once first);
        a process killed while building releases the lock, and the next one finishes the job. A bucket entry
        has no lock (see the module docstring).
        """
        if self.in_bucket:
            yield self
            return
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with open(self.directory.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                (notify or (lambda m: print(m, file=sys.stderr)))(
                    f"waiting for another run that is building the warm start {self.directory}"
                )
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                yield self
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class WarmStartCache:
    """The cache directory (local or a bucket); ``entry(config)`` is where that config's warm start lives."""

    def __init__(self, cache_dir: str | pathlib.Path):
        self.root = (
            paths.as_path(cache_dir) if paths.is_url(cache_dir) else pathlib.Path(cache_dir).expanduser().absolute()
        )

    def entry(self, config: RunConfig) -> CacheEntry:
        key = fingerprint(config)
        directory = self.root / key
        if not paths.is_url(directory):
            return CacheEntry(key, directory, directory)
        return CacheEntry(key, directory, pathlib.Path(paths.process_local_dir(directory, "warm_start")))
