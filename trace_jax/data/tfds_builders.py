"""TFDS builders (``array_record``, no TensorFlow needed) and grain iterators over them.

Two builders:

* :class:`SyntheticMultihop`: the synthetic world's ``train`` / ``test`` / ``ood`` questions (with gold
  turns); the world comes from ``WorldConfig`` fields of the builder config.
* :class:`SearchR1Local`: Search-R1-format question files a user placed in a *manual directory*:
  ``<manual_dir>/<split>.jsonl`` or ``<split>.parquet`` (split in train / dev / test) with
  ``golden_answers`` (a string or a list; Search-R1's ``reward_model.ground_truth.target`` is read too),
  ``data_source``, and ``prompt`` (the chat messages the policy reads, as Search-R1's parquet holds them)
  and/or ``question``. A row without ``question`` takes it from ``extra_info.question``, else from the
  content of its last user message (for scoring logs); a row without ``prompt`` is rendered from
  ``question`` by the environment's template. Configs ``multihop`` (hotpotqa, 2wikimultihopqa, musique,
  bamboogle), ``singlehop`` (nq, triviaqa, popqa) and ``all`` pick rows by ``data_source``. Malformed rows
  are skipped, counted and the first few logged with their line; a missing file, a file with neither a
  ``question`` nor a ``prompt`` column, or a split with no valid row raises.

Only ``file_format='array_record'`` works without TensorFlow: ``download_and_prepare`` and
``as_data_source`` then run on numpy alone. :func:`make_iterator` reads a split through grain with a
checkpointable iterator (``get_state()`` / ``set_state()``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import grain
import numpy as np
import tensorflow_datasets as tfds
from etils import epath

from trace_jax import paths
from trace_jax.data.synthetic import SyntheticWorld, WorldConfig

log = logging.getLogger(__name__)

SEARCH_R1_SPLITS = ("train", "dev", "test")
MULTIHOP_SOURCES = ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SINGLEHOP_SOURCES = ("nq", "triviaqa", "popqa")
MAX_REPORTED = 5  # malformed rows logged one by one; the rest are only counted

_QA_FEATURES = {
    "id": tfds.features.Text(),
    "question": tfds.features.Text(),
    "golden_answers": tfds.features.Sequence(tfds.features.Text()),
    "data_source": tfds.features.Text(),
}
# A Search-R1 row's chat messages, kept as parallel role / content lists ([] when the row has none).
_PROMPT_FEATURES = {
    "prompt_roles": tfds.features.Sequence(tfds.features.Text()),
    "prompt_contents": tfds.features.Sequence(tfds.features.Text()),
}


# ------------------------------------------------------------------------------------ synthetic world
@dataclasses.dataclass
class SyntheticConfig(tfds.core.BuilderConfig):
    """A builder config carrying the world's ``WorldConfig`` fields (``seed``, ``scale``...)."""

    world: WorldConfig = dataclasses.field(default_factory=WorldConfig)


class SyntheticMultihop(tfds.core.GeneratorBasedBuilder):
    """The synthetic multi-hop world as TFDS splits ``train`` / ``test`` / ``ood``."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        SyntheticConfig(name="default", description="WorldConfig() defaults")
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        features = dict(_QA_FEATURES, hops=np.int32, gold_turns=tfds.features.Sequence(tfds.features.Text()))
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        world = SyntheticWorld(self.builder_config.world)
        return {split: self._generate_examples(world.questions(split)) for split in ("train", "test", "ood")}

    def _generate_examples(self, rows):
        keys = ("id", "question", "golden_answers", "data_source", "hops", "gold_turns")
        for row in rows:
            yield row["id"], {k: row[k] for k in keys}


# -------------------------------------------------------------------------------- Search-R1 local files
@dataclasses.dataclass
class SearchR1Config(tfds.core.BuilderConfig):
    """``sources``: the ``data_source`` values kept (empty = all)."""

    sources: tuple[str, ...] = ()


@dataclasses.dataclass
class ReadReport:
    """Outcome of reading one file: valid rows, how many were malformed, the first few with their line."""

    rows: list[dict[str, Any]]
    malformed: int = 0
    filtered: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)


def _answers(row: Mapping[str, Any]) -> list[str]:
    answers = row.get("golden_answers")
    if answers is None:  # Search-R1's parquet keeps them under reward_model.ground_truth.target
        answers = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    if isinstance(answers, str):
        answers = [answers]
    if isinstance(answers, np.ndarray):
        answers = answers.tolist()
    if not isinstance(answers, list | tuple) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError("golden_answers must be a non-empty string or list of non-empty strings")
    return list(answers)


def _messages(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The row's ``prompt`` chat messages ([] when it has none), or ValueError when they are malformed."""
    prompt = row.get("prompt")
    if prompt is None:
        return []
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ValueError("prompt must be a non-empty list of {role, content} messages")
    messages = []
    for message in prompt:
        if not isinstance(message, Mapping) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise ValueError("every prompt message must have a string role and content")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _question(row: Mapping[str, Any], messages: list[dict[str, str]]) -> str:
    """``question``, else ``extra_info.question``, else the last user message's content."""
    question = row.get("question")
    if question is None:
        question = (row.get("extra_info") or {}).get("question")
    if question is None:
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), None)
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string (or the prompt must hold a user message)")
    return question.strip()


def _clean_row(row: Any, fallback_id: str) -> dict[str, Any]:
    """A valid ``{id, question, golden_answers, data_source, prompt_roles, prompt_contents}`` row, or ValueError
    saying what is wrong."""
    if not isinstance(row, Mapping):
        raise ValueError(f"a row must be an object, got {type(row).__name__}")
    messages = _messages(row)
    question = _question(row, messages)
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        raise ValueError("data_source must be a non-empty string")
    return {
        "id": str(row.get("id", fallback_id)),
        "question": question,
        "golden_answers": _answers(row),
        "data_source": source,
        "prompt_roles": [m["role"] for m in messages],
        "prompt_contents": [m["content"] for m in messages],
    }


def _raw_rows(path: epath.Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed row or the exception that parsing raised) for jsonl; (row number, row) for parquet.
    ``path`` may be in a bucket: both formats are read through the file object ``path.open`` gives."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only parquet question files need it

        with path.open("rb") as f:
            table = pq.read_table(f)
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row
        return
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, e


def read_search_r1_file(path: str | os.PathLike, sources: tuple[str, ...] = ()) -> ReadReport:
    """Reads a jsonl / parquet question file, local or ``gs://``; rows not in ``sources`` (when given) are filtered,
    not malformed."""
    path = paths.as_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {path} does not exist")
    report = ReadReport(rows=[])
    columns: set[str] = set()
    for line, raw in _raw_rows(path):
        if isinstance(raw, Mapping):
            columns.update(raw)
        try:
            if isinstance(raw, Exception):
                raise ValueError(f"not JSON ({raw.msg})")
            row = _clean_row(raw, fallback_id=f"{path.stem}-{line}")
        except (ValueError, AttributeError) as e:
            report.malformed += 1
            if len(report.examples) < MAX_REPORTED:
                report.examples.append(f"{path.name}:{line}: {e}")
            continue
        if sources and row["data_source"].lower() not in sources:
            report.filtered += 1
            continue
        report.rows.append(row)
    if columns and not columns & {"question", "prompt"}:
        raise ValueError(
            f"{path} has neither a 'question' nor a 'prompt' column (columns: {sorted(columns)}); "
            "Search-R1 rows need one of them, plus golden_answers and data_source"
        )
    if report.malformed:
        log.warning("%s: skipped %d malformed rows, e.g. %s", path, report.malformed, "; ".join(report.examples))
    if not report.rows:
        raise ValueError(
            f"{path} has no valid row (malformed: {report.malformed}, other data_source: {report.filtered}); "
            f"rows need question or prompt, golden_answers and data_source. First problems: {report.examples}"
        )
    return report


class SearchR1Local(tfds.core.GeneratorBasedBuilder):
    """Search-R1-format QA files from a manual directory (see the module docstring)."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES: ClassVar[dict[str, str]] = {
        "1.0.0": "Initial release.",
        "1.1.0": "The rows' prompt chat messages.",
    }
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put Search-R1-format files named <split>.jsonl or <split>.parquet (split: train, dev, test) with "
        "prompt and/or question, golden_answers and data_source in the manual directory "
        "(download_config.manual_dir)."
    )
    BUILDER_CONFIGS: ClassVar[list[tfds.core.BuilderConfig]] = [
        SearchR1Config(name="multihop", sources=MULTIHOP_SOURCES, description="HotpotQA, 2Wiki, MuSiQue, Bamboogle"),
        SearchR1Config(name="singlehop", sources=SINGLEHOP_SOURCES, description="NQ, TriviaQA, PopQA"),
        SearchR1Config(name="all", sources=(), description="every row"),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        features = dict(_QA_FEATURES, **_PROMPT_FEATURES)
        return self.dataset_info_from_configs(features=tfds.features.FeaturesDict(features))

    def _split_generators(self, dl_manager):
        manual = dl_manager.manual_dir  # an epath.Path: a bucket's folder stays a URL
        files = search_r1_files(manual)
        if not files:
            raise FileNotFoundError(
                f"no question file in {manual}; expected one of "
                f"{[f'{s}{e}' for s in SEARCH_R1_SPLITS for e in ('.jsonl', '.parquet')]}"
            )
        self.reports = {split: read_search_r1_file(path, self.builder_config.sources) for split, path in files.items()}
        return {split: self._generate_examples(report.rows) for split, report in self.reports.items()}

    def _generate_examples(self, rows):
        for i, row in enumerate(rows):
            yield f"{i}-{row['id']}", row


def search_r1_files(directory: str | os.PathLike) -> dict[str, epath.Path]:
    """The question file of each split ``directory`` (local or ``gs://``) holds, by split (``.jsonl`` before
    ``.parquet``)."""
    directory = paths.as_path(directory)
    files = {}
    for split in SEARCH_R1_SPLITS:
        found = [
            directory / f"{split}{ext}" for ext in (".jsonl", ".parquet") if (directory / f"{split}{ext}").is_file()
        ]
        if found:
            files[split] = found[0]
    return files


# --------------------------------------------------------------------------------------------- reading
PUBLISHED = "published.json"  # written last into a bucket's copy of a prepared dataset: its presence means complete


def prepare(
    builder_cls: type[tfds.core.DatasetBuilder], data_dir: str | os.PathLike, publish: bool = True, **kwargs
) -> Any:
    """Builds (once) and returns an ``array_record`` builder; ``manual_dir`` (local or ``gs://``) for
    :class:`SearchR1Local`.

    ``data_dir`` may be a bucket URL. array_record reads and writes only local files (a ``gs://`` data_dir fails
    to write and hangs on read), so then the builder works in a process-local folder (``paths.process_local_dir``)
    and the bucket keeps the prepared files for every host and later run: a complete copy there (marked by
    ``PUBLISHED``, written last) is copied down instead of preparing again; otherwise this process prepares from
    the source files and, when ``publish`` (process 0 alone: one writer), copies the result up. A host that finds
    no complete copy prepares its own, the same files, so no process waits on another.
    """
    manual_dir = kwargs.pop("manual_dir", None)
    needs_manual = bool(getattr(builder_cls, "MANUAL_DOWNLOAD_INSTRUCTIONS", None))
    if needs_manual and (manual_dir is None or not paths.as_path(manual_dir).is_dir()):
        raise FileNotFoundError(
            f"{builder_cls.__name__} reads a manual directory, and {manual_dir!r} is not one: "
            f"{builder_cls.MANUAL_DOWNLOAD_INSTRUCTIONS}"
        )
    if not paths.is_url(data_dir):
        return _prepare_here(builder_cls, data_dir, manual_dir, **kwargs)
    local = paths.process_local_dir(data_dir, "tfds")
    version = builder_cls(data_dir=str(local), file_format="array_record", **kwargs).data_path
    remote = paths.as_path(data_dir) / os.path.relpath(version, local)
    if (remote / PUBLISHED).is_file():
        paths.copy_tree(remote, version)
        return _prepare_here(builder_cls, local, manual_dir, **kwargs)
    builder = _prepare_here(builder_cls, local, manual_dir, **kwargs)
    if publish:
        paths.copy_tree(version, remote)
        (remote / PUBLISHED).write_text(json.dumps({"from": str(manual_dir or "")}))
    return builder


def _prepare_here(builder_cls: type[tfds.core.DatasetBuilder], data_dir: Any, manual_dir: Any, **kwargs) -> Any:
    builder = builder_cls(data_dir=str(data_dir), file_format="array_record", **kwargs)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    return builder


def _decode(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, list | tuple) or (isinstance(value, np.ndarray) and value.dtype == object):
        return [_decode(v) for v in list(value)]
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim else value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def decode_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A TFDS record as plain Python (bytes -> str, arrays -> lists): the task dict the env expects.

    A Search-R1 record's ``prompt_roles`` / ``prompt_contents`` become ``prompt``: its chat messages
    (``[{"role", "content"}, ...]``), present only when the row had them.
    """
    task = {key: _decode(value) for key, value in row.items() if key not in _PROMPT_FEATURES}
    if "prompt_roles" in row:
        roles, contents = _decode(row["prompt_roles"]), _decode(row["prompt_contents"])
        if roles:
            task["prompt"] = [{"role": r, "content": c} for r, c in zip(roles, contents, strict=True)]
    return task


def make_iterator(
    builder: tfds.core.DatasetBuilder, split: str, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None
) -> grain.DatasetIterator:
    """A grain iterator over decoded rows of ``split``: reshuffled each epoch, endless when ``num_epochs`` is None.

    The iterator is checkpointable: ``state = it.get_state()`` (JSON-able) and ``it.set_state(state)``
    continue at the same next element.
    """
    source = builder.as_data_source(split=split)
    dataset = grain.MapDataset.source(source)
    if shuffle:
        dataset = dataset.shuffle(seed=seed)
    dataset = dataset.repeat(num_epochs).map(decode_row)
    return iter(dataset.to_iter_dataset())
