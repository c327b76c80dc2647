"""A shared cache of warm starts (tokenizer + SFT policy), keyed by everything that determines them.

Two runs whose world, tokenizer, ReAct, retriever and SFT settings agree get the same warm start, so it is trained once
and every later run (an ablation, a rerun in a fresh workdir, ``trace_jax.evaluate``) reuses it; ablations of
one recipe therefore start RL from the very same model. The key is a hash of those config sections, the
format version below, the jax version (numerics may change between versions) and the code that computes a
warm start (:data:`CODE`, read as syntax trees: a comment, a docstring or a reformatting keeps the key; any
other edit trains a new warm start, so an edited SFT loop, world, tokenizer, renderer or model is never
served a stale one); the run's seed for RL, its allocation policy, optimizer and so on are not part of it.

Layout under ``cache_dir`` (default ``~/.cache/trace_jax/warm_start``)::

    <key>/tokenizer/       the world's BPE (a HF tokenizer directory)
    <key>/sft/             orbax checkpoint of the SFT params (``trace_jax.job.sft.run_sft``)
    <key>/warm_start.json  what was trained and how (written last: its presence means complete)
    <key>.lock             held while one run builds the entry; concurrent runs wait for it

    entry = WarmStartCache(cache_dir).entry(config)
    with entry.building():          # exclusive; returns at once when nobody else builds it
        ...train into entry.directory...
        entry.write_info({...})
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
    """One warm start's directory in the cache."""

    key: str
    directory: pathlib.Path

    @property
    def info_path(self) -> pathlib.Path:
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
        """Records ``info`` atomically (written to a temporary file, then renamed): the entry is complete."""
        tmp = self.info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(info), indent=2, sort_keys=True) + "\n")
        tmp.replace(self.info_path)

    @contextlib.contextmanager
    def building(self, notify: Any = None) -> Iterator[CacheEntry]:
        """Exclusive access to the entry while it is checked and, if needed, built.

        Another process building the same key makes this wait (``notify(message)`` is called once first);
        a process killed while building releases the lock, and the next one finishes the job.
        """
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
    """The cache directory; ``entry(config)`` is where that config's warm start lives."""

    def __init__(self, cache_dir: str | pathlib.Path):
        if paths.is_url(cache_dir):
            raise ValueError(
                f"warm_start.cache_dir={cache_dir!s}: the warm-start cache takes file locks, which buckets do not "
                "have; use a local path, or a shared filesystem when several hosts run one job"
            )
        self.root = pathlib.Path(cache_dir).expanduser().absolute()

    def entry(self, config: RunConfig) -> CacheEntry:
        key = fingerprint(config)
        return CacheEntry(key, self.root / key)
