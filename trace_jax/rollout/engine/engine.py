"""The decode engine: a fixed set of compiled programs over decode slots with a paged KV cache.

Shaped like JetStream's ``Engine`` (``init_decode_state``, ``insert``, ``bulk_insert``, ``generate``,
``free_resource``, ``max_concurrent_decodes``), with what rollout trees need and what a pod needs:

* ``append(params, state, items)`` is the one prefill program: each item appends ids to a slot, either
  starting a fresh sequence in it (``reset``: a prompt or an anchor history, i.e. prefill + insert) or
  continuing it (an observation: prefill-extend). All refills of a host round trip go in one call;
  ``insert`` and ``extend`` are its two special cases. An item may ``hold`` its history's pages (a
  pages-only ``Prefix``) and a later fresh sequence may ``start`` from such a hold: it shares the pages and
  computes only the ids past it (``trace_jax.rollout.engine.append``);
* ``fork(state, sources, children, seeds)`` (``bulk_insert``) starts k new sequences from live slots'
  histories: the children's page tables point at the parents' full KV pages and only the last, partly
  filled page is copied (``trace_jax.rollout.engine.pages``); nothing is recomputed;
* ``generate`` runs up to ``steps_per_call`` decode steps for every running slot in one ``lax.while_loop``;
  each slot stops on its own: a stop sequence (multi-token), EOS, its per-turn token limit or a full cache.
  ``generate_async`` dispatches it and returns a handle, so the host can judge finished turns (environment,
  retrieval, rewards) while the device decodes; ``generate`` is dispatch + fetch;
* ``free_resource(state, slots)`` is host bookkeeping only (the slots' pages return to the pool).

The host keeps the bookkeeping (``SlotState``: lengths, running flags, page tables) in numpy, updated from
the one packed array each ``generate`` returns, so no call syncs device state back except that array.
Every shape is bucketed (an append's ids in fixed-width chunks, its rows to ``append_rows`` and the cache
window it reads to ``append_window_buckets``, a fork's rows to ``row_buckets``, the cache window ``generate``
reads to ``length_buckets``), so the program set is small and known; ``warmup`` compiles all
of it ahead of time and any later compile is logged as a warning with its shapes (``ProgramSet``).

Weights: ``set_params`` makes the engine's own copy, cast to ``weight_dtype`` and laid out by the sampling
layout (``trace_jax.rollout.engine.layout``) once per policy update; every program takes them as an argument, so new
weights compile nothing. One engine serves sampling and greedy evaluation (greedy is a per-slot flag).

KV cache: a page pool with a page table per slot (``trace_jax.rollout.engine.pages``); the model runs on a
``PagedKVCache`` and reads / writes each layer through the tables (``page_size = max_len`` is the contiguous
cache). The types the calls take and return live in ``trace_jax.rollout.engine.slots``; the programs' device code
lives in ``append`` / ``fork`` / ``decode_loop``, the sizes in ``config``; this module holds the state and calls.

Randomness: a sequence's draws depend only on the seed it was started with and the number of tokens it has
sampled, never on its slot or batch mates: a fork of k slots reproduces k independent runs with those seeds.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models import ModelConfig, abstract_model, lora
from trace_jax.parallel.mesh import make_mesh, traced_under
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.append import APPEND_FIELDS, append_program, pack_append, routing_spans
from trace_jax.rollout.engine.config import EngineConfig
from trace_jax.rollout.engine.decode_loop import decode_program
from trace_jax.rollout.engine.fork import fork_program, pack_fork
from trace_jax.rollout.engine.layout import SamplingLayout
from trace_jax.rollout.engine.programs import ProgramSet
from trace_jax.rollout.engine.slots import (
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

log = logging.getLogger(__name__)
# Page copies of one ``copy`` call (cross-shard forks), padded up to a power of two at least this.
MIN_COPY_BUCKET = 8


def _copy_program(state: DecodeState, pairs_c2: jax.Array) -> DecodeState:
    """Copies pages ``pairs_c2[i, 0] -> pairs_c2[i, 1]`` in both pools (forks across shards)."""
    source, dest = pairs_c2[:, 0], pairs_c2[:, 1]
    return state._replace(**pages.copy_pools(state, source, dest))


def _cast_floating(params: Any, dtype: str | None) -> Any:
    """Floating leaves of ``params`` cast to ``dtype`` (``None``: unchanged); under jit, with the sampling
    layout's output shardings, this is the once-per-step reshard from the training layout."""
    convert = lambda x: x.astype(dtype) if dtype and jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(convert, params)


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
        self.config = config or EngineConfig()
        # The engine's own model: the policy's, but with the engine's expert dispatch where it sets one (the
        # graph carries the config, so a changed one is rebuilt; the weights' tree and layout are the same).
        engine_model_config = self.config.model_config(model_config)
        if engine_model_config != model_config:
            graphdef, model_config = abstract_model(engine_model_config)[0], engine_model_config
        self.graphdef = graphdef
        self.model_config = model_config
        if self.config.routing_replay and model_config.routing_shape is None:
            raise ValueError(
                f"engine.routing_replay records a mixture of experts' routing, but the {model_config.family!r} "
                "policy is dense (no router): turn routing_replay off or use a mixture-of-experts model"
            )
        # Without a layout: the sampling layout on one device, so every program's outputs are pinned to the
        # inputs' placement (otherwise XLA may hand back another sharding object and the next call recompiles).
        self.layout = layout or SamplingLayout(make_mesh(devices=jax.devices()[:1]))
        layout = self.layout
        self.params: Any = None
        self._params_source: Any = None
        self.counters: collections.Counter[str] = collections.Counter()
        self._key_size = int(jax.random.key_data(jax.random.key(0)).shape[-1])
        self.programs = ProgramSet("engine")
        # Decode attention for the devices the programs are compiled for (never the host's backend): the Pallas
        # paged-attention kernel in shard_map on a TPU mesh where its constraints hold, else the reference.
        self.platform = layout.mesh.devices.flat[0].platform
        self.decode_kernel, self.decode_attention = pages.choose_decode_kernel(
            model_config, self.config, layout.mesh, layout.state_shardings(self)
        )
        if self.platform == "tpu" and self.decode_kernel is None:
            log.warning("engine decode attention on TPU: %s", self.decode_attention)
        else:
            log.info("engine decode attention: %s", self.decode_attention)
        # Off CPU the programs are traced under the mesh (activation constraints apply, as in the planner's
        # compiles); the CPU programs stay as they were.
        under = (lambda fn: fn) if self.platform == "cpu" else (lambda fn: traced_under(layout.mesh, fn))
        # The decode state (its KV pool above all) is donated by every program, so XLA updates it in place;
        # without donation each call would hold two pools and copy between them.
        # With a layout, outputs keep the state's shardings, so each program's inputs never change signature.
        state_out = layout.state_shardings(self)
        out = lambda *o: {"out_shardings": o[0] if len(o) == 1 else o}
        replicated = layout.replicated
        # The state is born with its shardings (each device allocates only its shards, never all on one).
        self.programs.define("init", self._build_state, **out(state_out))
        prefill = functools.partial(append_program, graphdef, self.config)
        # With the routing record, append also returns each appended id's experts (a third output).
        appended = (replicated,) * (2 if self.config.routing_replay else 1)
        self.programs.define("append", under(prefill), donate_argnums=(1,), **out(state_out, *appended))
        self.programs.define("fork", under(fork_program), donate_argnums=(0,), **out(state_out))
        self.programs.define("copy", under(_copy_program), donate_argnums=(0,), **out(state_out))
        decode = functools.partial(decode_program, graphdef, self.config, kernel=self.decode_kernel)
        self.programs.define("generate", under(decode), donate_argnums=(1,), **out(state_out, replicated))
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
    def routing_shape(self) -> tuple[int, int] | None:
        """(sparse layers, top-k) of each token's routing record (sampled and appended); None when not recording."""
        return self.model_config.routing_shape if self.config.routing_replay else None

    @property
    def compilations(self) -> collections.Counter[str]:
        return self.programs.compilations

    # -------------------------------------------------------------------------------------- weights
    def set_params(self, params: nnx.State) -> nnx.State:
        """The engine's own copy of ``params`` in the sampling layout (cast to ``weight_dtype``); done once per
        new ``params`` object (calling again with the same object is free). Returns the copy.

        ``params`` is the whole policy or, once the engine holds an adapted one, its LoRA factors alone
        (``lora.trained_part``): those replace the held factors, and only they are moved and cast; the base the
        engine holds stays where it is (the decode programs merge base and factors per layer)."""
        if params is not self._params_source:
            self._params_source = params
            program = "reshard_adapters" if lora.adapters_only(params) else "reshard"
            self.params = lora.received(self.params, self._convert(params, program))
        return self.params

    def _convert(self, params: nnx.State, program: str) -> nnx.State:
        if program not in self.programs:  # its output shardings follow the weights' tree
            placed = {"out_shardings": self.layout.param_shardings(params)}
            self.programs.define(program, functools.partial(_cast_floating, dtype=self.config.weight_dtype), **placed)
        return self.programs(program, params)

    def _weights(self, params: Any) -> Any:
        return self.params if params is None else params

    # ---------------------------------------------------------------------------------------- state
    def init_decode_state(self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()) -> SlotState:
        """Empty slots (all ``IDLE``) with the stop tables every turn is checked against."""
        cfg = self.config
        tables = self._stop_tables(stop_sequences, eos_ids)
        device = self.programs("init", *self._put(*tables))
        shards = 1 if self.decode_kernel is None else self.decode_kernel.shards
        pool = pages.PagePool(cfg.pool_pages, cfg.page, cfg.max_slots, cfg.pages_per_slot, shards)
        zeros = np.zeros(cfg.max_slots, np.int32)
        bank = list(range(cfg.max_slots))[::-1]
        return SlotState(device, pool, zeros, zeros.astype(bool), zeros.astype(bool), bank, tables)

    def state_shapes(self) -> DecodeState:
        """``jax.ShapeDtypeStruct`` of every ``DecodeState`` field (no memory)."""
        return jax.eval_shape(lambda: self._build_state(*self._stop_tables((), ())))

    def _build_state(self, stops: np.ndarray, stop_len: np.ndarray, eos: np.ndarray) -> DecodeState:
        cfg, mc = self.config, self.model_config
        b, width = cfg.max_slots, cfg.max_stop_len
        pool_shape = (mc.num_kv_heads, mc.num_layers, cfg.pool_pages, cfg.page, mc.head_dim)
        kv_dtype = cfg.kv_dtype(mc.compute_dtype)
        stored = pages.pool_dtype(kv_dtype, self.platform)  # values or their bits
        scales = lambda: jnp.ones(pool_shape[:-1], jnp.float32) if pages.is_quantized(kv_dtype) else None
        return DecodeState(
            k_pages=jnp.zeros(pool_shape, stored),
            v_pages=jnp.zeros(pool_shape, stored),
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
            k_scales=scales(),
            v_scales=scales(),
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
        # Nothing held (every slot free, every hold dropped): the pool and the prefix bank hand out pages and
        # rows in their initial order, as a fresh state would (a resumed run gets the same pages).
        state.pool.settle()
        if len(state.bank_free) == self.config.max_slots:
            state.bank_free = list(range(self.config.max_slots))[::-1]
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

    def _put(self, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
        """Host arrays (copied: the caller may reuse their buffers) on the engine's devices, replicated, in one
        transfer call."""
        return jax.device_put(tuple(np.array(a) for a in arrays), self.layout.replicated)

    # --------------------------------------------------------------------------------------- append
    def append(
        self, params: nnx.State | None, state: SlotState, items: Sequence[AppendItem]
    ) -> tuple[SlotState, AppendResult]:
        """Appends each item's ids to its slot in one program (see ``AppendItem``); donates the device state.

        Every named slot starts a new turn (a slot named with no ids just starts one). Returns the state and
        an ``AppendResult`` (hidden states, kept prefixes; with ``routing_replay``, the appended ids' experts).
        """
        table, packed, window, kept, held = pack_append(self.config, state, items)
        self._copy_pending(state)
        self.counters["append_calls"] += 1
        self.counters["append_tokens"] += int(packed[:, -APPEND_FIELDS + 1].sum())  # ids the model runs
        self.counters["append_padded_tokens"] += packed.shape[0] * (packed.shape[1] - APPEND_FIELDS)  # rows x width
        device, hidden_kd, *routing = self.programs(
            "append", self._weights(params), state.device, *self._put(table, packed), static=(window,)
        )
        state.device = device
        if not routing:
            return state, AppendResult(hidden_kd, kept, held)
        return state, AppendResult(hidden_kd, kept, held, routing[0], routing_spans(packed, len(items)))

    def drop_prefix(self, state: SlotState, prefix: Prefix) -> SlotState:
        """Gives a kept prefix's pages and bank row back (host only)."""
        state.pool.drop(prefix.pages)
        if prefix.row is not None:
            state.bank_free.append(prefix.row)
        return state

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
        packed = pack_fork(self.config, state, sources, children, seeds, greedy, turn_limit)
        self._copy_pending(state)
        self.counters["fork_calls"] += 1
        self.counters["forked_sequences"] += len(children)
        state.device = self.programs("fork", state.device, *self._put(packed))
        return state

    def bulk_insert(self, state: SlotState, source: Prefix, slots: Sequence[int], seeds: Sequence[int]) -> SlotState:
        """JetStream's name for the fork of one prefix into many slots."""
        return self.fork(state, [source] * len(slots), slots, seeds)

    def _copy_pending(self, state: SlotState) -> None:
        """Runs the page copies of forks across shards (shard-local pages only; none otherwise)."""
        copies = state.pool.take_copies()
        if not copies:
            return
        size = max(MIN_COPY_BUCKET, 1 << (len(copies) - 1).bit_length())
        pairs = np.full((size, 2), pages.TRASH_PAGE, np.int32)
        pairs[: len(copies)] = copies
        self.counters["cross_shard_page_copies"] += len(copies)
        state.device = self.programs("copy", state.device, *self._put(pairs))

    # ------------------------------------------------------------------------------------- generate
    def abstract_generate_args(self, params: Any = None, window: int | None = None) -> tuple[tuple, int]:
        """``(args, window)``: ``generate``'s arguments as sharded ``jax.ShapeDtypeStruct`` (weights in the
        sampling layout and ``weight_dtype`` unless ``params``, abstract or not, is given) and its window
        (default ``max_len``, the widest: the loop reads every cache position)."""
        cfg = self.config
        struct = lambda x, s=None: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s or getattr(x, "sharding", None))
        if params is None:
            params = abstract_model(self.model_config)[1]
            params = jax.eval_shape(functools.partial(_cast_floating, dtype=cfg.weight_dtype), params)
            params = jax.tree.map(struct, params, self.layout.param_shardings(params))
        else:
            params = jax.tree.map(struct, params)
        state = jax.tree.map(struct, self.state_shapes(), self.layout.state_shardings(self))
        host = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.layout.replicated)
        args = (params, state, host((cfg.max_slots, cfg.pages_per_slot)), host((cfg.max_slots + 1,)))
        return args, cfg.max_len if window is None else cfg.length_bucket(window, "window")

    def lower_generate(self, params: Any = None, window: int | None = None) -> Any:
        """``jax.stages.Lowered`` of the very ``generate`` program this engine runs, for abstract arguments
        (``abstract_generate_args``); ``.compile()`` it for memory / cost analysis or its HLO. Compile for a
        topology by building the engine on a mesh of that topology's devices: the decode kernel follows the
        mesh's devices, never the host's backend."""
        args, window = self.abstract_generate_args(params, window)
        return self.programs.jitted("generate", static=(window,)).lower(*args)

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
            *self._put(state.pool.table, np.concatenate([[after], state.running]).astype(np.int32)),
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
        """Compiles the whole program set ahead of time and marks it warm: from now on every compile is logged
        as a warning. Each program then runs once on inputs that change nothing (padding rows, no running
        slot), since an executable's first run costs more than the next ones. Returns the number compiled."""
        cfg = self.config
        if state.running.any():
            raise ValueError("warmup runs each program on an idle state; call it before any slot is filled")
        before = self.programs.total
        weights = self._weights(params)
        b, width = cfg.max_slots, cfg.append_width
        padding = np.zeros((max(*cfg.append_rows, *cfg.rows), width + APPEND_FIELDS), np.int32)
        padding[:, width] = padding[:, width + 6] = b  # append: every row targets slot B (dropped)
        table = np.full((padding.shape[0], cfg.pages_per_slot), pages.TRASH_PAGE, np.int32)
        no_child = np.zeros((padding.shape[0], 8), np.int32)
        no_child[:, 1] = b  # fork: every row's child is slot B (dropped)
        calls = [("fork", (no_child[:rows],), ()) for rows in cfg.rows]
        calls += [("append", (table[:rows], padding[:rows]), (window,)) for rows, window in cfg.append_shapes]
        idle = np.zeros(b + 1, np.int32)  # refill_after 0 and no running slot: the loop ends at once
        calls += [
            ("generate", (table[:b], idle), (window,))
            for window in cfg.lengths
            if window >= min(cfg.steps_per_call, cfg.max_len)
        ]
        if state.pool.shards > 1:  # forks across slot shards copy pages: every bucket of the copy program
            size = MIN_COPY_BUCKET
            while size < 2 * cfg.max_slots * cfg.pages_per_slot:
                calls.append(("copy", (np.zeros((size, 2), np.int32),), ()))
                size *= 2
        struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for name, host, static in calls:
            model = () if name in ("fork", "copy") else (weights,)
            args = (*model, state.device, *self._put(*host))
            self.programs.compile(name, *jax.tree.map(struct, args), static=static)
            out = self.programs(name, *args, static=static)
            state.device = out if name in ("fork", "copy") else out[0]
        jax.block_until_ready(state.device)
        self.programs.mark_warm()
        return self.programs.total - before

    # --------------------------------------------------------------------------------------- report
    def describe(self) -> dict[str, Any]:
        """Compiled programs per entry point, work counters and the decode attention (``"pallas_paged"``,
        ``"pallas_paged_int8"`` or ``"reference: <why>"``), for benchmarks, logs and the planner."""
        return {
            "compilations": dict(self.compilations),
            "counters": dict(self.counters),
            "decode_attention": self.decode_attention,
        }
