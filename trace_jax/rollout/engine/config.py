"""The engine's static sizes (``EngineConfig``) and the buckets every engine shape is padded to."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from trace_jax.buckets import bucket
from trace_jax.config_utils import documented
from trace_jax.models.expert_dispatch import EXPERT_DISPATCH
from trace_jax.rollout.engine.sampling import SamplingConfig


def _is_cache_dtype(name: str) -> bool:
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        return False
    return jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.int8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine (each distinct value compiles new programs)."""

    max_slots: int = documented(16, "decode slots (``max_concurrent_decodes``), the batch of every decode step.")
    max_len: int = documented(512, "cache positions per slot (prompt + all turns + observations).")
    steps_per_call: int = documented(
        64,
        "most decode steps one ``generate`` call runs (the width of its output buffers).",
    )
    max_turn_tokens: int = documented(
        128,
        "per-turn token limit (a slot's turn ends after this many sampled tokens), unless a runner passes its own "
        "(``RunnerConfig.max_turn_tokens``; the main job's runners do not).",
    )
    min_bucket: int = documented(16, "smallest length bucket.")
    length_buckets: tuple[int, ...] = documented(
        (),
        "the cache windows ``generate`` reads are padded up to one of these (``()``: ``min_bucket * 4**i``, then "
        "``max_len``).",
    )
    row_buckets: tuple[int, ...] = documented((), "rows of a fork call (``()``: ``max_slots // 4`` and ``max_slots``).")
    append_chunk: int = documented(
        32,
        "ids per append row (``0`` or >= ``max_len``: ``max_len``, one row per item). An appended item is cut into "
        "chunks of this many ids, one row each, so an append's cost follows its ids, not its longest item "
        "(``trace_jax.rollout.engine.append``).",
    )
    append_row_buckets: tuple[int, ...] = documented(
        (),
        "rows of an append call (``()``: powers of two from ``max_slots // 4`` up to the most chunks a call can hold, "
        "``max_slots * ceil(max_len / append_chunk)``).",
    )
    append_windows: tuple[int, ...] = documented(
        (),
        "cache positions an append's attention reads, padded up to one of these from the call's longest history "
        "(``()``: ``max_len // 4``, ``max_len // 2``, ``max_len``); its cost grows with rows x window.",
    )
    page_size: int = documented(
        16,
        "KV positions per page (``0`` or >= ``max_len``: the contiguous cache); must divide ``max_len``.",
    )
    num_pages: int = documented(0, "pages in the pool (``0``: every slot at ``max_len`` plus one page per slot).")
    max_stop_sequences: int = documented(4, "capacity of the stop tables.")
    max_stop_len: int = documented(8, "capacity of the stop tables.")
    max_eos: int = documented(4, "capacity of the stop tables.")
    sampling: SamplingConfig = documented(
        default_factory=SamplingConfig,
        doc=("temperature / top-k / top-p (``SamplingConfig.make_greedy()`` for greedy)."),
    )
    weight_dtype: str | None = documented("bfloat16", "dtype of the engine's copy of the weights (``None``: as given).")
    cache_dtype: str | None = documented(
        None,
        "KV cache dtype name (a float dtype, or ``int8``: int8 values with one float32 scale per position and KV "
        "head, about half a bf16 cache's bytes; ``trace_jax.rollout.engine.pages``); ``None`` = the model's compute "
        "dtype. int8 is off by default: its figures are in docs/tpu_speed.md#int8-kv-cache.",
    )
    expert_dispatch: str = documented(
        "",
        "a mixture-of-experts policy only: the expert dispatch the engine's programs run (a key of "
        '``trace_jax.models.expert_dispatch.EXPERT_DISPATCH``: ``gather`` or ``all_to_all``); ``""`` = the '
        "model's own (``MoeConfig.expert_dispatch``), which the update always keeps. Both dispatches split the "
        "experts' weights over the same ``expert`` axis, so a weight sync moves them as any other weight. Decode "
        "wants ``all_to_all`` where the mesh has an ``expert`` axis (docs/tpu_speed.md, 'A mixture of experts').",
    )
    routing_replay: bool = documented(
        False,
        "a mixture-of-experts policy only: the engine records the experts every token it computes went to in every "
        "sparse layer: ``generate`` each sampled token's (``GenerateOutput.routing``), ``append`` each prompt and "
        "observation id's (``AppendResult.routing``). The rollout trees keep one record per token "
        "(``Node.routed_experts``) and the trainer's forward replays them all (``trace_jax.models.moe``), context "
        "included; costs tokens x sparse layers x top-k int32 on the host (1.5 KiB a token for Qwen3-30B-A3B). Off, "
        "the programs are those of a dense model's engine (no record, no extra output). A dense policy has no router: "
        "the engine refuses it.",
    )

    def __post_init__(self):
        if self.cache_dtype is not None and not _is_cache_dtype(self.cache_dtype):
            raise ValueError(
                f"EngineConfig.cache_dtype={self.cache_dtype!r} is not a KV cache dtype: use a float dtype name "
                "(bfloat16, float32), 'int8', or None for the model's compute dtype"
            )
        if self.expert_dispatch and self.expert_dispatch not in EXPERT_DISPATCH:
            raise ValueError(
                f"EngineConfig.expert_dispatch={self.expert_dispatch!r}: use one of {tuple(EXPERT_DISPATCH)}, or '' "
                "for the model's own"
            )
        if self.max_len % self.page:
            raise ValueError(f"EngineConfig.page_size={self.page_size} must divide max_len={self.max_len}")
        for name in ("length_buckets", "append_windows"):
            if any(not 0 < b <= self.max_len for b in getattr(self, name)):
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must lie in [1, max_len={self.max_len}]")

    @property
    def page(self) -> int:
        return min(self.page_size, self.max_len) if self.page_size else self.max_len

    @property
    def pages_per_slot(self) -> int:
        return self.max_len // self.page

    @property
    def pool_pages(self) -> int:
        # Default: every slot at max_len plus one page per slot of slack (the trash page, kept prefixes); a
        # multiple of max_slots, so the pool splits evenly wherever the slots do.
        return self.num_pages or self.max_slots * (self.pages_per_slot + 1)

    @property
    def lengths(self) -> tuple[int, ...]:
        """The length buckets, ascending, always ending at ``max_len``."""
        if self.length_buckets:
            sizes = set(self.length_buckets)
        else:
            sizes, size = set(), self.min_bucket
            while size < self.max_len:
                sizes.add(size)
                size *= 4
        return tuple(sorted(sizes | {self.max_len}))

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.row_buckets or (max(1, self.max_slots // 4), self.max_slots))))

    @property
    def append_width(self) -> int:
        """Ids per append row (the chunk width)."""
        return min(self.append_chunk, self.max_len) if self.append_chunk > 0 else self.max_len

    @property
    def append_rows(self) -> tuple[int, ...]:
        """The row buckets of an append call, ascending; the last holds every slot's longest history."""
        most = self.max_slots * -(-self.max_len // self.append_width)
        if self.append_row_buckets:
            return tuple(sorted(set(self.append_row_buckets)))
        sizes, size = {most}, max(1, self.max_slots // 4)
        while size < most:
            sizes.add(size)
            size *= 2
        return tuple(sorted(sizes))

    @property
    def append_window_buckets(self) -> tuple[int, ...]:
        """The append windows, ascending, always ending at ``max_len``."""
        given = self.append_windows or (self.max_len // 4, self.max_len // 2)
        return tuple(sorted({w for w in given if w > 0} | {self.max_len}))

    @property
    def append_shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (rows, window) an append call can have: a call whose histories fit window W holds at most
        ``max_slots * ceil(W / append_width)`` chunks, so only the row buckets up to that one pair with W."""
        shapes = []
        for window in self.append_window_buckets:
            most = bucket(self.max_slots * -(-window // self.append_width), self.append_rows, "append rows")
            shapes += [(rows, window) for rows in self.append_rows if rows <= most]
        return tuple(shapes)

    def model_config(self, model_config: Any) -> Any:
        """The config of the model the engine runs: ``model_config`` with ``expert_dispatch`` where one is set.
        Raises ``ValueError`` for a dispatch asked of a model without experts."""
        if not self.expert_dispatch:
            return model_config
        if not hasattr(model_config, "expert_dispatch"):
            raise ValueError(
                f"engine.expert_dispatch={self.expert_dispatch!r} chooses how a mixture of experts dispatches, but the "
                f"{model_config.family!r} policy is dense: set engine.expert_dispatch to ''"
            )
        return dataclasses.replace(model_config, expert_dispatch=self.expert_dispatch)

    def kv_dtype(self, compute_dtype: Any) -> jnp.dtype:
        """The KV cache's value dtype: ``cache_dtype``, else the model's ``compute_dtype``."""
        return jnp.dtype(self.cache_dtype) if self.cache_dtype else jnp.dtype(compute_dtype)

    def length_bucket(self, n: int, what: str) -> int:
        if n > self.max_len:
            raise ValueError(f"{what} has {n} tokens but EngineConfig.max_len={self.max_len}; raise max_len")
        return bucket(n, self.lengths, what)
