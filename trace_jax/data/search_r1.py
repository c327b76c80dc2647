"""Search-R1 question splits for a training run: the TFDS builder over local or ``gs://`` files, read through grain.

``SearchR1Data(config, cache_dir)`` prepares ``tfds_builders.SearchR1Local`` once (array_record files under
``cache_dir``) from the user's ``<dir>/<split>.jsonl|parquet`` files and serves

* ``questions(split)``: every row of a split in the prepared order (evaluation; rows carry ``data_source``, so
  EM/F1 come out per source, and ``prompt``, the row's chat messages, when the file had them);
* ``stream(split, batch_size, seed)``: a :class:`PromptBatches` over this process's shard of the split.

Sharding: process ``i`` of ``n`` (``jax.process_index()`` / ``jax.process_count()``) reads rows
``i, i + n, i + 2n, ...`` of the split, reshuffled every epoch; so the processes read disjoint rows.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import grain

from trace_jax import paths
from trace_jax.config_utils import documented
from trace_jax.data.tfds_builders import SearchR1Local, decode_row, prepare


@dataclasses.dataclass(frozen=True)
class SearchR1DataConfig:
    """Where the questions are."""

    dir: str = documented(
        "",
        "a directory (local or ``gs://``, read by every host) holding ``train`` / ``dev`` / ``test`` ``.jsonl`` or "
        "``.parquet`` files in the Search-R1 format "
        "(``prompt`` chat messages and/or ``question``, ``golden_answers`` or ``reward_model.ground_truth.target``, "
        "``data_source``).",
    )
    subset: str = documented(
        "all",
        'the builder config: "all", "multihop" (HotpotQA, 2Wiki, MuSiQue, Bamboogle) or "singlehop" (NQ, TriviaQA, '
        "PopQA).",
    )
    train_split: str = documented(
        "train",
        "the split RL samples prompts from (evaluation scores ``config.eval.split``).",
    )
    cache_dir: str = documented(
        "",
        'where the prepared array_record files go, local or ``gs://`` ("" = ``<workdir>/tfds``); a bucket keeps '
        "them for every host and later run, each reading its own local copy.",
    )


class PromptBatches:
    """Batches of task rows from a grain iterator; the iterator's position is the whole state.

    ``next_batch()`` returns ``batch_size`` decoded rows (dicts with ``question``, ``golden_answers``,
    ``data_source``, ``id``, and ``prompt`` when the row has chat messages). ``state_dict()`` is JSON-able;
    ``load_state_dict`` continues at the same row.
    """

    def __init__(self, dataset: grain.MapDataset, batch_size: int):
        if batch_size < 1 or batch_size > len(dataset):
            raise ValueError(f"batch_size must be in [1, {len(dataset)}] (this process's rows), got {batch_size}")
        self.batch_size = batch_size
        self._iterator = iter(dataset.repeat(None).map(decode_row).to_iter_dataset())

    def next_batch(self) -> list[dict[str, Any]]:
        return [next(self._iterator) for _ in range(self.batch_size)]

    def state_dict(self) -> dict[str, Any]:
        return {"grain": self._iterator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._iterator.set_state(state["grain"])


class SearchR1Data:
    """The prepared Search-R1 splits of a run (see the module docstring)."""

    def __init__(self, config: SearchR1DataConfig, cache_dir: str | os.PathLike, publish: bool = True):
        """``config.dir`` and the cache (``config.cache_dir``, else ``cache_dir``) may be local or ``gs://``;
        ``publish``: this process writes a bucket cache's prepared files (process 0 alone, see
        ``tfds_builders.prepare``)."""
        if not config.dir:
            raise ValueError("data.dir is empty: set --config.data.dir to the directory of Search-R1 train/test files")
        if not paths.as_path(config.dir).is_dir():
            raise FileNotFoundError(f"data.dir={config.dir!r} is not a directory of Search-R1 train/test files")
        self.config = config
        data_dir = config.cache_dir or os.fspath(cache_dir)
        self.builder = prepare(SearchR1Local, data_dir, publish, manual_dir=config.dir, config=config.subset)

    @property
    def splits(self) -> list[str]:
        return sorted(self.builder.info.splits.keys())

    def _source(self, split: str) -> Any:
        if split not in self.splits:
            raise ValueError(f"split {split!r} is not in {self.config.dir} (found {self.splits})")
        return self.builder.as_data_source(split=split)

    def questions(self, split: str) -> list[dict[str, Any]]:
        source = self._source(split)
        return [decode_row(source[i]) for i in range(len(source))]

    def stream(
        self, split: str, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
    ) -> PromptBatches:
        """Batches over rows ``process_index::process_count`` of ``split``, reshuffled each epoch."""
        shard = grain.MapDataset.source(self._source(split))[process_index::process_count]
        return PromptBatches(shard.shuffle(seed=seed), batch_size)
