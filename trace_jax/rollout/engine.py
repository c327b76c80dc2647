"""The decode engine: a fixed set of compiled programs over decode slots with a paged KV cache.

Shaped like JetStream's ``Engine`` (``init_decode_state``, ``insert``, ``bulk_insert``, ``generate``,
``free_resource``, ``max_concurrent_decodes``), with what rollout trees need and what a pod needs:

* ``append(params, state, items)`` is the one prefill program: each item appends ids to a slot, either
  starting a fresh sequence in it (``reset``: a prompt or an anchor history, i.e. prefill + insert) or
  continuing it (an observation: prefill-extend). All refills of a host round trip go in one call;
  ``insert`` and ``extend`` are its two special cases;
* ``fork(state, sources, children, seeds)`` (``bulk_insert``) starts k new sequences from live slots'
  histories: the children's page tables point at the parents' full KV pages and only the last, partly
  filled page is copied (``trace_jax.rollout.pages``); nothing is recomputed;
* ``generate`` runs up to ``steps_per_call`` decode steps for every running slot in one ``lax.while_loop``;
  each slot stops on its own: a stop sequence (multi-token), EOS, its per-turn token limit or a full cache.
  ``generate_async`` dispatches it and returns a handle, so the host can judge finished turns (environment,
  retrieval, rewards) while the device decodes; ``generate`` is dispatch + fetch;
* ``free_resource(state, slots)`` is host bookkeeping only (the slots' pages return to the pool).

The host keeps the bookkeeping (``SlotState``: lengths, running flags, page tables) in numpy, updated from
the one packed array each ``generate`` returns, so no call syncs device state back except that array.
Every shape is bucketed (rows of an append / fork to ``row_buckets``, appended ids and the cache window
``generate`` reads to ``length_buckets``), so the program set is small and known; ``warmup`` compiles all
of it ahead of time and any later compile is logged as a warning with its shapes (``ProgramSet``).

Weights: ``set_params`` makes the engine's own copy, cast to ``weight_dtype`` and laid out by the sampling
layout (``trace_jax.rollout.layout``) once per policy update; every program takes them as an argument, so new
weights compile nothing. One engine serves sampling and greedy evaluation (greedy is a per-slot flag).

KV cache: a page pool with a page table per slot (``trace_jax.rollout.pages``); the model runs on a
``PagedKVCache`` and reads / writes each layer through the tables (``page_size = max_len`` is the contiguous
cache). The types the calls take and return live in ``trace_jax.rollout.slots``.

Randomness: a sequence's draws depend only on the seed it was started with and the number of tokens it has
sampled, never on its slot or batch mates: a fork of k slots reproduces k independent runs with those seeds.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.buckets import bucket
from trace_jax.models.qwen import ModelConfig, abstract_model
from trace_jax.parallel.mesh import make_mesh
from trace_jax.rollout import pages
from trace_jax.rollout.layout import SamplingLayout
from trace_jax.rollout.programs import ProgramSet
from trace_jax.rollout.slots import (
    AppendItem,
    AppendResult,
    DecodeState,
    GenerateOutput,
    PendingGenerate,
    Prefix,
    SlotState,
    StopReason,
)

__all__ = [
    "AppendItem", "AppendResult", "DecodeState", "Engine", "EngineConfig", "GenerateOutput", "PendingGenerate",
    "Prefix", "SlotState", "StopReason",
]  # fmt: skip
from trace_jax.rollout.sampling import SamplingConfig, sample

_GREEDY = SamplingConfig.make_greedy()


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine (each distinct value compiles new programs).

    max_slots: decode slots (``max_concurrent_decodes``), the batch of every decode step.
    max_len: cache positions per slot (prompt + all turns + observations).
    steps_per_call: most decode steps one ``generate`` call runs (the width of its output buffers).
    max_turn_tokens: default per-turn token limit (a slot's turn ends after this many sampled tokens).
    min_bucket: smallest length bucket. length_buckets: ids per append row and cache windows of ``generate``
      are padded up to one of these (``()``: ``min_bucket * 4**i``, then ``max_len``).
    row_buckets: rows of an append / fork call (``()``: ``max_slots // 4`` and ``max_slots``).
    page_size: KV positions per page (``0`` or >= ``max_len``: the contiguous cache); must divide ``max_len``.
    num_pages: pages in the pool (``0``: every slot at ``max_len`` plus one page per slot).
    max_stop_sequences, max_stop_len, max_eos: capacity of the stop tables.
    sampling: temperature / top-k / top-p (``SamplingConfig.make_greedy()`` for greedy).
    weight_dtype: dtype of the engine's copy of the weights (``None``: as given).
    cache_dtype: KV cache dtype name; ``None`` = the model's compute dtype.
    """

    max_slots: int = 16
    max_len: int = 512
    steps_per_call: int = 64
    max_turn_tokens: int = 128
    min_bucket: int = 16
    length_buckets: tuple[int, ...] = ()
    row_buckets: tuple[int, ...] = ()
    page_size: int = 16
    num_pages: int = 0
    max_stop_sequences: int = 4
    max_stop_len: int = 8
    max_eos: int = 4
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    weight_dtype: str | None = "bfloat16"
    cache_dtype: str | None = None

    def __post_init__(self):
        if self.max_len % self.page:
            raise ValueError(f"EngineConfig.page_size={self.page_size} must divide max_len={self.max_len}")
        if any(b > self.max_len for b in self.length_buckets):
            raise ValueError(f"EngineConfig.length_buckets={self.length_buckets} exceed max_len={self.max_len}")

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

    def length_bucket(self, n: int, what: str) -> int:
        if n > self.max_len:
            raise ValueError(f"{what} has {n} tokens but EngineConfig.max_len={self.max_len}; raise max_len")
        return bucket(n, self.lengths, what)


def _cast_floating(params: Any, dtype: str | None) -> Any:
    """Floating leaves of ``params`` cast to ``dtype`` (``None``: unchanged); under jit, with the sampling
    layout's output shardings, this is the once-per-step reshard from the training layout."""
    convert = lambda x: x.astype(dtype) if dtype and jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(convert, params)


def _as_float(x: jax.Array) -> jax.Array:
    """int32 -> float32 bit pattern, so ints travel exactly inside the one packed float32 result array."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


class Engine:
    """Decode engine for one ``Qwen`` architecture (see the module docstring).

    Args:
      graphdef: ``nnx`` graph definition of the model (``nnx.split(model, nnx.Param)[0]``).
      model_config: the model's ``ModelConfig``.
      config: engine sizes and sampling.
      layout: a ``SamplingLayout`` (mesh + shardings of weights, slots and cache); ``None``: the first device.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        layout: Any = None,
    ):
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config or EngineConfig()
        # Without a layout: the sampling layout on one device, so every program's outputs are pinned to the
        # inputs' placement (otherwise XLA may hand back another sharding object and the next call recompiles).
        self.layout = layout or SamplingLayout(make_mesh(devices=jax.devices()[:1]))
        layout = self.layout
        self.params: Any = None
        self._params_source: Any = None
        self.counters: collections.Counter[str] = collections.Counter()
        self._key_size = int(jax.random.key_data(jax.random.key(0)).shape[-1])
        self.programs = ProgramSet("engine")
        # The decode state (its KV pool above all) is donated by every program, so XLA updates it in place;
        # without donation each call would hold two pools and copy between them.
        # With a layout, outputs keep the state's shardings, so each program's inputs never change signature.
        state_out = layout.state_shardings(self)
        out = lambda *o: {"out_shardings": o[0] if len(o) == 1 else o}
        replicated = layout.replicated
        # The state is born with its shardings (each device allocates only its shards, never all on one).
        self.programs.define("init", self._build_state, **out(state_out))
        self.programs.define("append", self._append_impl, donate_argnums=(1,), **out(state_out, replicated))
        self.programs.define("fork", self._fork_impl, donate_argnums=(0,), **out(state_out))
        self.programs.define("generate", self._generate_impl, donate_argnums=(1,), **out(state_out, replicated))
        self._parked: SlotState | None = None

    @classmethod
    def for_model(cls, model_config: ModelConfig, config: EngineConfig | None = None, layout: Any = None) -> Engine:
        """An engine for ``Qwen(model_config)`` (graph only; weights come from ``set_params`` or each call)."""
        return cls(abstract_model(model_config)[0], model_config, config, layout)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    @property
    def compilations(self) -> collections.Counter[str]:
        return self.programs.compilations

    # -------------------------------------------------------------------------------------- weights
    def set_params(self, params: nnx.State) -> nnx.State:
        """The engine's own copy of ``params`` in the sampling layout (cast to ``weight_dtype``); done once per
        new ``params`` object (calling again with the same object is free). Returns the copy."""
        if params is not self._params_source:
            self._params_source = params
            self.params = self._convert(params)
        return self.params

    def _convert(self, params: nnx.State) -> nnx.State:
        if "reshard" not in self.programs:  # its output shardings follow the weights' tree
            placed = {"out_shardings": self.layout.param_shardings(params)}
            self.programs.define("reshard", functools.partial(_cast_floating, dtype=self.config.weight_dtype), **placed)
        return self.programs("reshard", params)

    def _weights(self, params: Any) -> Any:
        return self.params if params is None else params

    # ---------------------------------------------------------------------------------------- state
    def init_decode_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> SlotState:
        """Empty slots (all ``IDLE``) with the stop tables every turn is checked against."""
        cfg = self.config
        tables = self._stop_tables(stop_sequences, eos_ids)
        device = self.programs("init", *(self._put(table) for table in tables))
        pool = pages.PagePool(cfg.pool_pages, cfg.page, cfg.max_slots, cfg.pages_per_slot)
        zeros = np.zeros(cfg.max_slots, np.int32)
        bank = list(range(cfg.max_slots))[::-1]
        return SlotState(device, pool, zeros, zeros.astype(bool), zeros.astype(bool), bank, tables)

    def state_shapes(self) -> DecodeState:
        """``jax.ShapeDtypeStruct`` of every ``DecodeState`` field (no memory)."""
        return jax.eval_shape(lambda: self._build_state(*self._stop_tables((), ())))

    def _build_state(self, stops: np.ndarray, stop_len: np.ndarray, eos: np.ndarray) -> DecodeState:
        cfg, mc = self.config, self.model_config
        b, width = cfg.max_slots, cfg.max_stop_len
        pool_shape = (mc.num_layers, mc.num_kv_heads, cfg.pool_pages, cfg.page, mc.head_dim)
        dtype = jnp.dtype(cfg.cache_dtype) if cfg.cache_dtype else mc.compute_dtype
        return DecodeState(
            k_pages=jnp.zeros(pool_shape, dtype),
            v_pages=jnp.zeros(pool_shape, dtype),
            lengths_b=jnp.zeros((b,), jnp.int32),
            logits_bv=jnp.zeros((b, mc.vocab_size), jnp.float32),
            hidden_bd=jnp.zeros((b, mc.hidden_size), jnp.float32),
            keys_bk=jnp.zeros((b, self._key_size), jnp.uint32),
            sampled_b=jnp.zeros((b,), jnp.int32),
            turn_tokens_b=jnp.zeros((b,), jnp.int32),
            turn_limit_b=jnp.zeros((b,), jnp.int32),
            stop_reason_b=jnp.full((b,), StopReason.IDLE, jnp.int32),
            greedy_b=jnp.zeros((b,), jnp.bool_),
            recent_bw=jnp.full((b, width), -1, jnp.int32),
            stops_sw=jnp.asarray(stops),
            stop_len_s=jnp.asarray(stop_len),
            eos_e=jnp.asarray(eos),
            bank_logits_rv=jnp.zeros((b, mc.vocab_size), jnp.float32),
            bank_hidden_rd=jnp.zeros((b, mc.hidden_size), jnp.float32),
        )

    def _stop_tables(self, stop_sequences, eos_ids):
        cfg = self.config
        if len(stop_sequences) > cfg.max_stop_sequences or len(eos_ids) > cfg.max_eos:
            raise ValueError(
                f"{len(stop_sequences)} stop sequences / {len(eos_ids)} EOS ids exceed EngineConfig."
                f"max_stop_sequences={cfg.max_stop_sequences} / max_eos={cfg.max_eos}; raise them"
            )
        width = cfg.max_stop_len
        stops = np.full((cfg.max_stop_sequences, width), -1, np.int32)
        stop_len = np.zeros(cfg.max_stop_sequences, np.int32)
        for i, seq in enumerate(stop_sequences):
            if not 0 < len(seq) <= width:
                raise ValueError(f"stop sequence {list(seq)} must have 1..EngineConfig.max_stop_len={width} ids")
            stops[i, width - len(seq) :] = seq
            stop_len[i] = len(seq)
        eos = np.full(cfg.max_eos, -1, np.int32)
        eos[: len(eos_ids)] = list(eos_ids)
        return stops, stop_len, eos

    def acquire_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> SlotState:
        """The engine's one shared slot state (created on first use), with these stop tables. Runners sharing
        an engine take it for a batch of rollouts and hand it back with ``release_state``, so the KV pool
        exists once however many runners (sampling, evaluation) use the engine."""
        state, self._parked = self._parked, None
        if state is None:
            return self.init_decode_state(stop_sequences, eos_ids)
        tables = self._stop_tables(stop_sequences, eos_ids)
        if not all(np.array_equal(new, old) for new, old in zip(tables, state.stop_tables, strict=True)):
            device = state.device
            put = lambda new, old: jax.device_put(new, old.sharding)
            stops, stop_len, eos = tables
            state.device = device._replace(
                stops_sw=put(stops, device.stops_sw), stop_len_s=put(stop_len, device.stop_len_s),
                eos_e=put(eos, device.eos_e),
            )  # fmt: skip
            state.stop_tables = tables
        return state

    def release_state(self, state: SlotState) -> None:
        """Parks ``state`` for the next ``acquire_state`` (its slots must all be free)."""
        if state.active.any():
            raise ValueError(f"slots {np.flatnonzero(state.active).tolist()} are still active; free them first")
        self._parked = state

    def _put(self, array: np.ndarray) -> jax.Array:
        """A host array (copied: the caller may reuse its buffer) on the engine's devices, replicated."""
        sharding = self.layout.replicated
        return jax.device_put(np.array(array), sharding)

    # --------------------------------------------------------------------------------------- append
    def append(
        self, params: nnx.State | None, state: SlotState, items: Sequence[AppendItem]
    ) -> tuple[SlotState, AppendResult]:
        """Appends each item's ids to its slot in one program (see ``AppendItem``); donates the device state.

        Every named slot starts a new turn (a slot named with no ids just starts one). Returns the state and
        an ``AppendResult`` (hidden states, kept prefixes).
        """
        if not items:
            raise ValueError("append needs at least one item")
        cfg = self.config
        slots = [int(item.slot) for item in items]
        if any(not 0 <= s < cfg.max_slots for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and in [0, {cfg.max_slots})")
        longest = max(len(item.ids) for item in items)
        width = cfg.length_bucket(max(longest, 1), "appended ids")
        rows = bucket(len(items), cfg.rows, "append rows")
        packed = np.zeros((rows, width + 7), np.int32)
        packed[:, width] = packed[:, width + 6] = cfg.max_slots  # padding targets row B: every scatter drops it
        kept: list[Prefix | None] = []
        table = np.full((rows, cfg.pages_per_slot), pages.TRASH_PAGE, np.int32)
        for row, item in enumerate(items):
            ids = np.asarray(item.ids, np.int32).reshape(-1)
            if item.reset:
                if not len(ids):
                    raise ValueError(f"cannot start slot {item.slot} from an empty sequence")
                state.pool.release(item.slot)
                state.lengths[item.slot] = 0
            end = int(state.lengths[item.slot]) + len(ids)
            if end > cfg.max_len:
                raise ValueError(
                    f"slot {item.slot} would hold {end} tokens but EngineConfig.max_len={cfg.max_len}; raise max_len"
                )
            state.pool.reserve(item.slot, end)
            limit = cfg.max_turn_tokens if item.turn_limit is None else int(item.turn_limit)
            packed[row, : len(ids)] = ids
            table[row] = state.pool.table[item.slot]
            state.lengths[item.slot] = end
            state.running[item.slot] = state.active[item.slot] = True
            if item.keep and not state.bank_free:
                raise RuntimeError(f"all {cfg.max_slots} prefix bank rows are kept; drop_prefix the unused ones")
            kept.append(Prefix(state.bank_free.pop(), state.pool.hold(item.slot, end), end) if item.keep else None)
            bank = cfg.max_slots if kept[-1] is None else kept[-1].row
            packed[row, width:] = (item.slot, len(ids), item.reset, item.seed, item.greedy, limit, bank)
        self.counters["append_calls"] += 1
        self.counters["append_tokens"] += sum(len(item.ids) for item in items)
        device, hidden_kd = self.programs(
            "append", self._weights(params), state.device, self._put(table), self._put(packed)
        )
        state.device = device
        return state, AppendResult(hidden_kd[: len(items)], kept)

    def drop_prefix(self, state: SlotState, prefix: Prefix) -> SlotState:
        """Gives a kept prefix's pages and bank row back (host only)."""
        state.pool.drop(prefix.pages)
        state.bank_free.append(prefix.row)
        return state

    def _append_impl(self, params, state: DecodeState, table_kp, packed_kc):
        model = nnx.merge(self.graphdef, params)
        cfg = self.config
        width = packed_kc.shape[1] - 7
        tokens_kt = packed_kc[:, :width]
        slot_k, num_new_k, reset_k, seed_k, greedy_k, limit_k, bank_k = (packed_kc[:, width + i] for i in range(7))
        k = tokens_kt.shape[0]
        rows_k = jnp.minimum(slot_k, cfg.max_slots - 1)  # padding rows compute on a copy, then drop
        reset_k = reset_k > 0
        lengths_k = jnp.where(reset_k, 0, state.lengths_b[rows_k])
        # The model writes the new keys / values straight into the named slots' pages and reads their whole
        # history through the page tables (padding rows' tables point at the trash page).
        cache = pages.PagedKVCache(state.k_pages, state.v_pages, table_kp, lengths_k, jnp.arange(cfg.max_len))
        hidden_ktd, cache = model.hidden(tokens_kt, cache, num_new_k)
        last_kd = hidden_ktd[jnp.arange(k), jnp.maximum(num_new_k - 1, 0)]
        grown_k1 = (num_new_k > 0)[:, None]
        hidden_kd = jnp.where(grown_k1, last_kd.astype(jnp.float32), state.hidden_bd[rows_k])
        logits_kv = jnp.where(grown_k1, model.logits(last_kd), state.logits_bv[rows_k])
        new_keys_kk = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seed_k.astype(jnp.uint32))
        put = lambda dst, src: dst.at[slot_k].set(src.astype(dst.dtype), mode="drop")
        zeros = jnp.zeros_like(slot_k)
        state = state._replace(
            k_pages=cache.k_pages,
            v_pages=cache.v_pages,
            lengths_b=put(state.lengths_b, cache.lengths),
            logits_bv=put(state.logits_bv, logits_kv),
            hidden_bd=put(state.hidden_bd, hidden_kd),
            keys_bk=put(state.keys_bk, jnp.where(reset_k[:, None], new_keys_kk, state.keys_bk[rows_k])),
            sampled_b=put(state.sampled_b, jnp.where(reset_k, 0, state.sampled_b[rows_k])),
            turn_tokens_b=put(state.turn_tokens_b, zeros),
            turn_limit_b=put(state.turn_limit_b, limit_k),
            stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
            # Like the seed, greedy is the sequence's: set when it starts, kept when ids are appended.
            greedy_b=put(state.greedy_b, jnp.where(reset_k, greedy_k > 0, state.greedy_b[rows_k])),
            recent_bw=put(state.recent_bw, jnp.full((k, state.recent_bw.shape[1]), -1, jnp.int32)),
            bank_logits_rv=state.bank_logits_rv.at[bank_k].set(logits_kv, mode="drop"),
            bank_hidden_rd=state.bank_hidden_rd.at[bank_k].set(hidden_kd, mode="drop"),
        )
        return state, hidden_kd

    def insert(
        self,
        params: nnx.State | None,
        state: SlotState,
        sequences: Sequence[Sequence[int]],
        slots: Sequence[int],
        seeds: Sequence[int],
        *,
        greedy: bool = False,
        turn_limit: int | None = None,
        keep: bool = False,
    ) -> tuple[SlotState, AppendResult]:
        """Prefills ``sequences[i]`` into slot ``slots[i]`` (a fresh sequence with PRNG seed ``seeds[i]``)."""
        items = [
            AppendItem(slot, seq, True, seed, greedy, turn_limit, keep)
            for seq, slot, seed in zip(sequences, slots, seeds, strict=True)
        ]
        return self.append(params, state, items)

    def extend(
        self,
        params: nnx.State | None,
        state: SlotState,
        tokens_by_slot: Mapping[int, Sequence[int] | np.ndarray],
        turn_limit: int | None = None,
    ) -> tuple[SlotState, AppendResult]:
        """Appends ids to live slots (observations) and starts a new turn in each."""
        items = [AppendItem(slot, ids, greedy=False, turn_limit=turn_limit) for slot, ids in tokens_by_slot.items()]
        return self.append(params, state, items)

    # ----------------------------------------------------------------------------------------- fork
    def fork(
        self,
        state: SlotState,
        sources: Sequence[Prefix],
        children: Sequence[int],
        seeds: Sequence[int],
        *,
        greedy: bool = False,
        turn_limit: int | None = None,
    ) -> SlotState:
        """Starts sequence ``children[i]`` from the kept prefix ``sources[i]`` with seed ``seeds[i]`` (one program,
        no recomputation): full KV pages are shared, the last partly filled page is copied. The children start
        a new turn from the prefix's next-token logits."""
        cfg = self.config
        if not len(sources) == len(children) == len(seeds):
            raise ValueError(f"fork got {len(sources)} sources, {len(children)} children and {len(seeds)} seeds")
        if any(not 0 <= s < cfg.max_slots for s in children) or len(set(children)) != len(children):
            raise ValueError(f"slots {list(children)} must be distinct and in [0, {cfg.max_slots})")
        rows = bucket(len(children), cfg.rows, "fork rows")
        packed = np.zeros((rows, 8), np.int32)
        packed[:, 1] = cfg.max_slots
        limit = cfg.max_turn_tokens if turn_limit is None else int(turn_limit)
        for row, (source, child, seed) in enumerate(zip(sources, children, seeds, strict=True)):
            copy = state.pool.fork(source.pages, child, source.length)
            packed[row] = (source.row, child, seed, *copy, greedy, limit, source.length)
            state.lengths[child] = source.length
            state.running[child] = state.active[child] = True
        self.counters["fork_calls"] += 1
        self.counters["forked_sequences"] += len(children)
        state.device = self.programs("fork", state.device, self._put(packed))
        return state

    def bulk_insert(self, state: SlotState, source: Prefix, slots: Sequence[int], seeds: Sequence[int]) -> SlotState:
        """JetStream's name for the fork of one prefix into many slots."""
        return self.fork(state, [source] * len(slots), slots, seeds)

    def _fork_impl(self, state: DecodeState, packed_kc):
        row_k, child_k, seed_k, copy_from_k, copy_to_k, greedy_k, limit_k, length_k = (
            packed_kc[:, i] for i in range(8)
        )
        put = lambda dst, src: dst.at[child_k].set(src.astype(dst.dtype), mode="drop")
        keys_kk = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seed_k.astype(jnp.uint32))
        zeros = jnp.zeros_like(child_k)
        return state._replace(
            k_pages=pages.copy_pages(state.k_pages, copy_from_k, copy_to_k),
            v_pages=pages.copy_pages(state.v_pages, copy_from_k, copy_to_k),
            lengths_b=put(state.lengths_b, length_k),
            logits_bv=put(state.logits_bv, state.bank_logits_rv[row_k]),
            hidden_bd=put(state.hidden_bd, state.bank_hidden_rd[row_k]),
            keys_bk=put(state.keys_bk, keys_kk),
            sampled_b=put(state.sampled_b, zeros),
            turn_tokens_b=put(state.turn_tokens_b, zeros),
            turn_limit_b=put(state.turn_limit_b, limit_k),
            stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
            greedy_b=put(state.greedy_b, greedy_k > 0),
            recent_bw=put(state.recent_bw, jnp.full((len(child_k), state.recent_bw.shape[1]), -1, jnp.int32)),
        )

    # ------------------------------------------------------------------------------------- generate
    def generate_async(
        self, params: nnx.State | None, state: SlotState, refill_after: int | None = None
    ) -> tuple[SlotState, PendingGenerate]:
        """Dispatches one ``generate`` call and returns at once; ``handle.result()`` waits for it."""
        cfg = self.config
        after = cfg.max_slots + 1 if refill_after is None else max(int(refill_after), 1)
        running = np.flatnonzero(state.running)
        longest = int(state.lengths[running].max()) if len(running) else 0
        window = cfg.length_bucket(min(longest + cfg.steps_per_call, cfg.max_len), "window")
        for slot in running:  # pages for every position this call can write
            state.pool.reserve(int(slot), min(int(state.lengths[slot]) + cfg.steps_per_call, cfg.max_len))
        self.counters["generate_calls"] += 1
        state.device, packed = self.programs(
            "generate",
            self._weights(params),
            state.device,
            self._put(state.pool.table),
            self._put(np.concatenate([[after], state.running]).astype(np.int32)),
            static=(window,),
        )
        return state, PendingGenerate(self, state, packed)

    def generate(
        self, params: nnx.State | None, state: SlotState, refill_after: int | None = None
    ) -> tuple[SlotState, GenerateOutput]:
        """Decodes every running slot for up to ``steps_per_call`` steps in one device loop (one host copy).

        The loop ends early when no slot is running, or once ``refill_after`` turns have ended in this call
        (so a host loop can refill freed slots at once; default: never early). Each sampled token is also
        run through the model (so the cache holds the whole turn, stop sequence included). Attention reads
        each slot's first ``W`` positions through its page table, ``W`` the length bucket of the longest
        running slot + ``steps_per_call``.
        """
        state, pending = self.generate_async(params, state, refill_after)
        return state, pending.result()

    def _generate_impl(self, window: int, params, state: DecodeState, table_bp, control):
        model = nnx.merge(self.graphdef, params)
        cfg = self.config
        b, n, max_len = cfg.max_slots, cfg.steps_per_call, cfg.max_len
        refill_after, host_running_b = control[0], control[1:] > 0
        # The host's running flags rule: a slot it freed without decoding (its turn never ended) goes IDLE.
        reason_b = state.stop_reason_b
        idle_b = ~host_running_b & (reason_b == StopReason.RUNNING)
        state = state._replace(stop_reason_b=jnp.where(idle_b, StopReason.IDLE, reason_b))
        # Attention reads each slot's first ``window`` positions through its page table, layer by layer.
        cache = pages.PagedKVCache(state.k_pages, state.v_pages, table_bp, state.lengths_b, jnp.arange(window))

        def step_fn(carry):
            step, st, cache, out, num_b, ended = carry
            running_b = st.stop_reason_b == StopReason.RUNNING
            keys_b = jax.vmap(lambda data, i: jax.random.fold_in(jax.random.wrap_key_data(data), i))(
                st.keys_bk, st.sampled_b
            )
            drawn = sample(st.logits_bv, keys_b, cfg.sampling)
            if not cfg.sampling.greedy:
                best = sample(st.logits_bv, keys_b, _GREEDY)
                drawn = jax.tree.map(lambda g, d: jnp.where(st.greedy_b, g, d), best, drawn)
            token_b = jnp.where(running_b, drawn.tokens, 0)
            hidden_b1d, cache = model.hidden(token_b[:, None], cache, running_b.astype(jnp.int32))
            logits_bv = model.logits(hidden_b1d[:, 0])
            columns = (token_b, drawn.logprobs, drawn.sample_logprobs, drawn.entropies)
            out = tuple(buf.at[:, step].set(col.astype(buf.dtype)) for buf, col in zip(out, columns, strict=True))
            grow_b = running_b.astype(jnp.int32)
            turn_tokens_b = st.turn_tokens_b + grow_b
            recent_bw = jnp.where(
                running_b[:, None], jnp.concatenate([st.recent_bw[:, 1:], token_b[:, None]], axis=1), st.recent_bw
            )
            matches_bs = jnp.all((recent_bw[:, None, :] == st.stops_sw[None]) | (st.stops_sw[None] < 0), axis=-1)
            stop_b = jnp.any(matches_bs & (st.stop_len_s[None] > 0), axis=-1)
            eos_b = jnp.any(token_b[:, None] == st.eos_e[None], axis=-1)
            reason_b = jnp.select(
                [stop_b, eos_b, turn_tokens_b >= st.turn_limit_b, cache.lengths >= max_len],
                [StopReason.STOP_SEQUENCE, StopReason.EOS, StopReason.TURN_LIMIT, StopReason.CONTEXT_FULL],
                StopReason.RUNNING,
            )
            running_col = running_b[:, None]
            st = st._replace(
                lengths_b=cache.lengths,
                logits_bv=jnp.where(running_col, logits_bv, st.logits_bv),
                hidden_bd=jnp.where(running_col, hidden_b1d[:, 0].astype(jnp.float32), st.hidden_bd),
                sampled_b=st.sampled_b + grow_b,
                turn_tokens_b=turn_tokens_b,
                stop_reason_b=jnp.where(running_b, reason_b, st.stop_reason_b),
                recent_bw=recent_bw,
            )
            ended = ended + jnp.sum(running_b & (reason_b != StopReason.RUNNING))
            return step + 1, st, cache, out, num_b + grow_b, ended

        def keep_going(carry):
            step, st, _, _, _, ended = carry
            return (step < n) & jnp.any(st.stop_reason_b == StopReason.RUNNING) & (ended < refill_after)

        out = (
            jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b, n), jnp.float32),
            jnp.zeros((b, n), jnp.float32),
            jnp.zeros((b, n), jnp.float32),
        )
        # The pools travel in the loop carry (as the cache), so XLA updates them in place.
        carry = (jnp.int32(0), state._replace(k_pages=None, v_pages=None), cache, out, jnp.zeros((b,), jnp.int32))
        carry = (*carry, jnp.int32(0))
        steps, state, cache, (tokens, logprobs, sample_logprobs, entropies), num_b, _ = jax.lax.while_loop(
            keep_going, step_fn, carry
        )
        state = state._replace(k_pages=cache.k_pages, v_pages=cache.v_pages)
        packed = jnp.concatenate(
            [
                _as_float(tokens),
                logprobs,
                sample_logprobs,
                entropies,
                _as_float(num_b)[:, None],
                _as_float(state.stop_reason_b)[:, None],
                _as_float(jnp.full((b, 1), steps)),
                state.hidden_bd,
            ],
            axis=1,
        )
        return state, packed

    # ----------------------------------------------------------------------------------------- free
    def free_resource(self, state: SlotState, slots: int | Sequence[int]) -> SlotState:
        """Frees slots (host bookkeeping only: their pages return to the pool, nothing runs on device). The
        next ``generate`` gets the host's running flags, so a freed slot is never decoded until refilled.
        Do not free a slot an in-flight ``generate_async`` decodes."""
        for slot in [slots] if isinstance(slots, int | np.integer) else slots:
            state.pool.release(int(slot), int(state.lengths[slot]))
            state.lengths[slot] = 0
            state.active[slot] = state.running[slot] = False
        return state

    # ------------------------------------------------------------------------------------- warm-up
    def warmup(self, params: nnx.State | None, state: SlotState) -> int:
        """Compiles the whole program set ahead of time (no data runs) and marks it warm: from now on every
        compile is logged as a warning. Returns the number of programs compiled."""
        cfg = self.config
        before = self.programs.total
        struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        weights = jax.tree.map(struct, self._weights(params))
        device = jax.tree.map(struct, state.device)
        host = lambda shape: struct(self._put(np.zeros(shape, np.int32)))
        for rows in cfg.rows:
            self.programs.compile("fork", device, host((rows, 8)))
            for width in cfg.lengths:
                self.programs.compile(
                    "append", weights, device, host((rows, cfg.pages_per_slot)), host((rows, width + 7))
                )
        table = host((cfg.max_slots, cfg.pages_per_slot))
        for window in cfg.lengths:
            if window >= min(cfg.steps_per_call, cfg.max_len):
                self.programs.compile("generate", weights, device, table, host((cfg.max_slots + 1,)), static=(window,))
        self.programs.mark_warm()
        return self.programs.total - before

    # --------------------------------------------------------------------------------------- report
    def describe(self) -> dict[str, Any]:
        """Compiled programs per entry point and work counters, for benchmarks and logs."""
        return {"compilations": dict(self.compilations), "counters": dict(self.counters)}
