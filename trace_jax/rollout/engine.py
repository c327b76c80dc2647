"""The decode engine: jit-compiled prefill / insert / fork / extend / multi-step generate over slots.

Shaped like JetStream's ``Engine`` (``init_decode_state``, ``prefill``, ``insert``, ``bulk_insert``,
``generate``, ``free_resource``, ``max_concurrent_decodes``) with what rollout trees need on top:

* ``bulk_insert(prefix, state, slots)`` is the fork: one prefilled prefix's KV rows are copied into k
  decode slots on device; the prefix is never recomputed;
* ``extend(params, state, tokens per slot)`` appends observation tokens to live slots (a prefill that
  continues a slot's cache; only the named slots' rows run through the model), returning the final hidden
  state at each slot's last new token, which is the success predictor's input at that anchor;
* ``generate`` runs up to ``steps_per_call`` decode steps for all slots inside one ``lax.while_loop``;
  each slot stops on its own: a stop sequence (multi-token), EOS, its per-turn token limit or a full cache.

Slots are independent sequences: each has its own cache length (write position), PRNG key, turn counter and
stop state, so prompts of different lengths need no left padding and a slot can be refilled while the
others keep decoding (continuous batching). Host-side methods take and return numpy; device-side state is a
pytree (``DecodeState``) that every mutating call *donates*: the caches are the biggest buffers in the
run, and donating lets XLA update them in place instead of holding two copies per call.

Shapes are bucketed (prefill / extend lengths, row and slot counts, and the cache window ``generate``
scans, to powers of two) so a run compiles a small fixed set of programs; ``Engine.compilations`` counts
traces per entry point. ``generate`` packs all its per-slot results into one array so each call costs one
device-to-host copy.

Token sampling and its log-probabilities are ``trace_jax.rollout.sampling``. A sequence's randomness
depends only on the seed it was inserted with and the number of tokens it has sampled, never on its slot
or its batch mates: a fork of k slots reproduces k independent runs with the same seeds.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from trace_jax.models.qwen import KVCache, ModelConfig, abstract_model
from trace_jax.rollout.sampling import SamplingConfig, sample


class StopReason(enum.IntEnum):
    """Why a slot's turn ended (``RUNNING`` while it goes on; ``IDLE`` for a free slot)."""

    RUNNING = 0
    STOP_SEQUENCE = 1
    EOS = 2
    TURN_LIMIT = 3
    CONTEXT_FULL = 4
    IDLE = 5


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static sizes of the engine (each distinct value compiles new programs).

    max_slots: decode slots (``max_concurrent_decodes``), the batch of every decode step.
    max_len: cache positions per slot (prompt + all turns + observations).
    steps_per_call: most decode steps one ``generate`` call runs (the width of its output buffers).
    max_turn_tokens: default per-turn token limit (a slot's turn ends after this many sampled tokens).
    min_bucket: smallest prefill / extend length bucket; lengths are padded up to powers of two.
    max_stop_sequences, max_stop_len, max_eos: capacity of the stop tables.
    sampling: temperature / top-k / top-p (``SamplingConfig.make_greedy()`` for greedy).
    cache_dtype: KV cache dtype name; ``None`` = the model's compute dtype.
    """

    max_slots: int = 16
    max_len: int = 512
    steps_per_call: int = 64
    max_turn_tokens: int = 128
    min_bucket: int = 16
    max_stop_sequences: int = 4
    max_stop_len: int = 8
    max_eos: int = 4
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    cache_dtype: str | None = None

    def length_bucket(self, n: int, what: str) -> int:
        """Smallest power of two >= ``n`` (and >= ``min_bucket``), capped at ``max_len``."""
        if n > self.max_len:
            raise ValueError(f"{what} has {n} tokens but EngineConfig.max_len={self.max_len}; raise max_len")
        return min(max(self.min_bucket, 1 << max(n - 1, 0).bit_length()), self.max_len)


def count_bucket(n: int) -> int:
    """Smallest power of two >= n (>= 1): the padded number of rows / slots of a call."""
    return 1 << max(n - 1, 0).bit_length()


class Prefix(NamedTuple):
    """Prefilled sequences (device): cache rows ``[layers, n, P, kv_heads, head_dim]`` with true lengths
    ``[n]``, next-token logits ``float32 [n, V]`` and final hidden state at the last token ``float32 [n, D]``."""

    cache: KVCache
    logits_nv: jax.Array
    hidden_nd: jax.Array

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.cache.lengths)


class DecodeState(NamedTuple):
    """Everything the decode slots carry between calls (device pytree; donated by every mutating call).

    cache: KV cache of all slots (per-slot ``lengths``).
    logits_bv: float32 [B, V] next-token logits of each slot (from its last forward).
    hidden_bd: float32 [B, D] final hidden state at each slot's last token.
    keys_bk: uint32 [B, key_size] raw PRNG key data of each slot's sequence.
    sampled_b: int32 [B] tokens sampled since the slot was inserted (the step of its key stream).
    turn_tokens_b / turn_limit_b: int32 [B] tokens sampled in the current turn / its limit.
    stop_reason_b: int32 [B] ``StopReason`` of the current turn.
    recent_bw: int32 [B, W] the turn's last W sampled ids (-1 before the turn's first), for stop matching.
    stops_sw: int32 [S, W] stop sequences right-aligned, left-padded with -1; stop_len_s: int32 [S] (0 unused).
    eos_e: int32 [E] EOS ids (-1 unused).
    """

    cache: KVCache
    logits_bv: jax.Array
    hidden_bd: jax.Array
    keys_bk: jax.Array
    sampled_b: jax.Array
    turn_tokens_b: jax.Array
    turn_limit_b: jax.Array
    stop_reason_b: jax.Array
    recent_bw: jax.Array
    stops_sw: jax.Array
    stop_len_s: jax.Array
    eos_e: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Host copy of one ``generate`` call. Row b's tokens of this call are ``tokens[b, :num_tokens[b]]``.

    tokens: int32 [B, N]; logprobs (untempered policy), sample_logprobs, entropies: float32 [B, N].
    num_tokens: int32 [B] tokens each slot sampled in this call. stop_reason: int32 [B] ``StopReason``
    after the call (``RUNNING``: the turn goes on at the next call). hidden: float32 [B, D] final hidden
    state at each slot's last token. steps: decode steps the loop ran.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    sample_logprobs: np.ndarray
    entropies: np.ndarray
    num_tokens: np.ndarray
    stop_reason: np.ndarray
    hidden: np.ndarray
    steps: int

    @classmethod
    def unpack(cls, packed: np.ndarray, hidden_size: int) -> GenerateOutput:
        """Reads the ``[B, 4N + 3 + D]`` float32 array ``generate`` returns (ints travel as bit patterns)."""
        packed = np.asarray(packed, np.float32)
        as_int = packed.view(np.int32)
        n = (packed.shape[1] - 3 - hidden_size) // 4
        return cls(
            tokens=as_int[:, :n].copy(),
            logprobs=packed[:, n : 2 * n].copy(),
            sample_logprobs=packed[:, 2 * n : 3 * n].copy(),
            entropies=packed[:, 3 * n : 4 * n].copy(),
            num_tokens=as_int[:, 4 * n].copy(),
            stop_reason=as_int[:, 4 * n + 1].copy(),
            hidden=packed[:, 4 * n + 3 :].copy(),
            steps=int(as_int[0, 4 * n + 2]),
        )


def _as_float(x: jax.Array) -> jax.Array:
    """int32 -> float32 bit pattern, so ints travel exactly inside the one packed float32 result array."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


class Engine:
    """Decode engine for one ``Qwen`` architecture. Parameters are passed to every call (never captured), so
    new policy weights need no recompilation.

    Args:
      graphdef: ``nnx`` graph definition of the model (``nnx.split(model, nnx.Param)[0]``).
      model_config: the model's ``ModelConfig``.
      config: engine sizes and sampling.
    """

    def __init__(self, graphdef: nnx.GraphDef, model_config: ModelConfig, config: EngineConfig | None = None):
        self.graphdef = graphdef
        self.model_config = model_config
        self.config = config or EngineConfig()
        self.compilations: collections.Counter[str] = collections.Counter()
        self.counters: collections.Counter[str] = collections.Counter()
        self._key_size = int(jax.random.key_data(jax.random.key(0)).shape[-1])
        self._prefill = jax.jit(self._prefill_impl)  # a prefix is not donated: a fork inserts it many times
        # The decode state (its KV cache above all) is donated by every call that returns a new one, so XLA
        # updates the cache in place; without donation each call would hold two caches and copy between them.
        self._insert = jax.jit(self._insert_impl, donate_argnums=(1,))
        self._extend = jax.jit(self._extend_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._generate_impl, donate_argnums=(1,), static_argnums=(3,))
        self._free = jax.jit(self._free_impl, donate_argnums=(0,))

    @classmethod
    def for_model(cls, model_config: ModelConfig, config: EngineConfig | None = None) -> Engine:
        """An engine for ``Qwen(model_config)`` (graph only; pass the params to each call)."""
        return cls(abstract_model(model_config)[0], model_config, config)

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_slots

    @property
    def hidden_size(self) -> int:
        return self.model_config.hidden_size

    # ---------------------------------------------------------------------------------------- state
    def init_decode_state(
        self, stop_sequences: Sequence[Sequence[int]] = (), eos_ids: Sequence[int] = ()
    ) -> DecodeState:
        """Empty slots (all ``IDLE``) with the stop tables every turn is checked against."""
        cfg, mc = self.config, self.model_config
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
        b = cfg.max_slots
        dtype = jnp.dtype(cfg.cache_dtype) if cfg.cache_dtype else None
        return DecodeState(
            cache=KVCache.init(mc, batch=b, max_len=cfg.max_len, dtype=dtype),
            logits_bv=jnp.zeros((b, mc.vocab_size), jnp.float32),
            hidden_bd=jnp.zeros((b, mc.hidden_size), jnp.float32),
            keys_bk=jnp.zeros((b, self._key_size), jnp.uint32),
            sampled_b=jnp.zeros((b,), jnp.int32),
            turn_tokens_b=jnp.zeros((b,), jnp.int32),
            turn_limit_b=jnp.zeros((b,), jnp.int32),
            stop_reason_b=jnp.full((b,), StopReason.IDLE, jnp.int32),
            recent_bw=jnp.full((b, width), -1, jnp.int32),
            stops_sw=jnp.asarray(stops),
            stop_len_s=jnp.asarray(stop_len),
            eos_e=jnp.asarray(eos),
        )

    # -------------------------------------------------------------------------------------- prefill
    def prefill(self, params: nnx.State, tokens: Sequence[int] | np.ndarray, true_length: int | None = None) -> Prefix:
        """Prefills one sequence (``tokens[:true_length]``; the rest is padding) into a one-row ``Prefix``."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = len(tokens) if true_length is None else int(true_length)
        return self.prefill_many(params, [tokens[:n]])

    def prefill_many(self, params: nnx.State, sequences: Sequence[Sequence[int] | np.ndarray]) -> Prefix:
        """Prefills several sequences in one call; row i of the ``Prefix`` is ``sequences[i]``.

        Rows are padded to a power of two (rows past ``len(sequences)`` are padding of length 1, never to be
        inserted) and lengths to a length bucket.
        """
        if not sequences:
            raise ValueError("prefill_many needs at least one sequence")
        lengths = [len(s) for s in sequences]
        if min(lengths) < 1:
            raise ValueError("cannot prefill an empty sequence; a prompt needs at least one token")
        width = self.config.length_bucket(max(lengths), "prefill sequence")
        rows = count_bucket(len(sequences))
        tokens = np.zeros((rows, width), np.int32)
        true = np.ones(rows, np.int32)
        for i, seq in enumerate(sequences):
            tokens[i, : lengths[i]] = np.asarray(seq, np.int32)
            true[i] = lengths[i]
        self.counters["prefill_calls"] += 1
        self.counters["prefill_sequences"] += len(sequences)
        self.counters["prefill_tokens"] += sum(lengths)
        return self._prefill(params, tokens, true)

    def _prefill_impl(self, params: nnx.State, tokens_nt: jax.Array, lengths_n: jax.Array) -> Prefix:
        self.compilations["prefill"] += 1
        model = nnx.merge(self.graphdef, params)
        n, t = tokens_nt.shape
        dtype = jnp.dtype(self.config.cache_dtype) if self.config.cache_dtype else None
        cache = KVCache.init(self.model_config, batch=n, max_len=t, dtype=dtype)
        hidden_ntd, cache = model.hidden(tokens_nt, cache, lengths_n)
        last_nd = hidden_ntd[jnp.arange(n), lengths_n - 1]
        return Prefix(cache, model.logits(last_nd), last_nd.astype(jnp.float32))

    # --------------------------------------------------------------------------------------- insert
    def insert(
        self, prefix: Prefix, decode_state: DecodeState, slot: int, seed: int = 0, turn_limit: int | None = None
    ) -> DecodeState:
        """Takes over ``slot`` with row 0 of ``prefix`` (its cache, logits, hidden) and starts a new turn."""
        return self.insert_rows(prefix, decode_state, [0], [slot], [seed], turn_limit)

    def bulk_insert(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        slots: Sequence[int],
        seeds: Sequence[int] | None = None,
        turn_limit: int | None = None,
    ) -> DecodeState:
        """The fork: row 0 of ``prefix`` into every slot of ``slots`` (on device, no re-prefill), one seed each."""
        seeds = list(range(len(slots))) if seeds is None else list(seeds)
        return self.insert_rows(prefix, decode_state, [0] * len(slots), slots, seeds, turn_limit)

    def insert_rows(
        self,
        prefix: Prefix,
        decode_state: DecodeState,
        rows: Sequence[int],
        slots: Sequence[int],
        seeds: Sequence[int],
        turn_limit: int | None = None,
    ) -> DecodeState:
        """Row ``rows[i]`` of ``prefix`` into slot ``slots[i]`` with PRNG seed ``seeds[i]``; donates the state."""
        if not len(rows) == len(slots) == len(seeds):
            raise ValueError(f"insert_rows got {len(rows)} rows, {len(slots)} slots and {len(seeds)} seeds")
        b, n = self.config.max_slots, prefix.logits_nv.shape[0]
        if any(not 0 <= s < b for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {list(slots)} must be distinct and in [0, {b})")
        if any(not 0 <= r < n for r in rows):
            raise ValueError(f"rows {list(rows)} must index the prefix's {n} rows")
        k = count_bucket(len(slots))
        limit = self.config.max_turn_tokens if turn_limit is None else int(turn_limit)
        pad = k - len(slots)
        # Padding entries target slot index B, which the scatters drop.
        rows_k = np.asarray(list(rows) + [0] * pad, np.int32)
        slots_k = np.asarray(list(slots) + [b] * pad, np.int32)
        seeds_k = np.asarray(list(seeds) + [0] * pad, np.uint32)
        return self._insert(prefix, decode_state, rows_k, slots_k, seeds_k, np.int32(limit))

    def _insert_impl(
        self, prefix: Prefix, state: DecodeState, rows_k: jax.Array, slots_k: jax.Array, seeds_k, limit
    ) -> DecodeState:
        self.compilations["insert"] += 1
        p = prefix.cache.k.shape[2]
        put = lambda dst, src: dst.at[slots_k].set(src, mode="drop")
        k = state.cache.k.at[:, slots_k, :p].set(prefix.cache.k[:, rows_k].astype(state.cache.k.dtype), mode="drop")
        v = state.cache.v.at[:, slots_k, :p].set(prefix.cache.v[:, rows_k].astype(state.cache.v.dtype), mode="drop")
        keys_kk = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seeds_k)
        zeros = jnp.zeros_like(slots_k)
        return state._replace(
            cache=KVCache(k, v, put(state.cache.lengths, prefix.cache.lengths[rows_k])),
            logits_bv=put(state.logits_bv, prefix.logits_nv[rows_k]),
            hidden_bd=put(state.hidden_bd, prefix.hidden_nd[rows_k]),
            keys_bk=put(state.keys_bk, keys_kk.astype(jnp.uint32)),
            sampled_b=put(state.sampled_b, zeros),
            turn_tokens_b=put(state.turn_tokens_b, zeros),
            turn_limit_b=put(state.turn_limit_b, zeros + limit),
            stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
            recent_bw=put(state.recent_bw, jnp.full((len(slots_k), state.recent_bw.shape[1]), -1, jnp.int32)),
        )

    # --------------------------------------------------------------------------------------- extend
    def extend(
        self,
        params: nnx.State,
        decode_state: DecodeState,
        tokens_by_slot: Mapping[int, Sequence[int] | np.ndarray],
        turn_limit: int | None = None,
    ) -> tuple[DecodeState, np.ndarray]:
        """Appends ids to the caches of the given slots (observations) and starts a new turn in each.

        A slot named with no ids just starts a new turn. Slots not named keep their state untouched. Only the
        named slots' cache rows go through the model (gathered into a sub-batch of a bucketed size, then
        scattered back), so the cost follows the slots extended, not ``max_slots``. Returns the donated-and-
        updated state and the final hidden states float32 [B, D] (host) at each named slot's last token
        (rows of other slots are zero). The caller keeps every slot's history within ``max_len``.
        """
        if not tokens_by_slot:
            raise ValueError("extend needs at least one slot")
        b = self.config.max_slots
        slots = list(tokens_by_slot)
        longest = max(len(ids) for ids in tokens_by_slot.values())
        width = self.config.length_bucket(max(longest, 1), "extend")
        k = min(count_bucket(max(len(slots), b // 8)), count_bucket(b))  # few sub-batch sizes, few programs
        tokens = np.zeros((k, width), np.int32)
        num_new = np.zeros(k, np.int32)
        slots_k = np.full(k, b, np.int32)  # padding rows target slot B, which the scatters drop
        for row, slot in enumerate(slots):
            ids = tokens_by_slot[slot]
            tokens[row, : len(ids)] = np.asarray(ids, np.int32)
            num_new[row] = len(ids)
            slots_k[row] = slot
        limit = self.config.max_turn_tokens if turn_limit is None else int(turn_limit)
        self.counters["extend_calls"] += 1
        self.counters["extend_tokens"] += int(num_new.sum())
        state, hidden_kd = self._extend(params, decode_state, slots_k, tokens, num_new, np.int32(limit))
        hidden_bd = np.zeros((b, self.hidden_size), np.float32)
        hidden_bd[slots] = np.asarray(hidden_kd)[: len(slots)]
        return state, hidden_bd

    def _extend_impl(
        self, params: nnx.State, state: DecodeState, slots_k: jax.Array, tokens_kt: jax.Array, num_new_k, limit
    ) -> tuple[DecodeState, jax.Array]:
        self.compilations["extend"] += 1
        model = nnx.merge(self.graphdef, params)
        k = tokens_kt.shape[0]
        rows_k = jnp.minimum(slots_k, self.config.max_slots - 1)  # padding rows compute on a copy, then drop
        full = state.cache
        sub = KVCache(full.k[:, rows_k], full.v[:, rows_k], full.lengths[rows_k])
        hidden_ktd, sub = model.hidden(tokens_kt, sub, num_new_k)
        last_kd = hidden_ktd[jnp.arange(k), jnp.maximum(num_new_k - 1, 0)]
        grown_k1 = (num_new_k > 0)[:, None]
        hidden_kd = jnp.where(grown_k1, last_kd.astype(jnp.float32), state.hidden_bd[rows_k])
        logits_kv = jnp.where(grown_k1, model.logits(last_kd), state.logits_bv[rows_k])
        put = lambda dst, src: dst.at[slots_k].set(src, mode="drop")
        zeros = jnp.zeros_like(slots_k)
        state = state._replace(
            cache=KVCache(
                full.k.at[:, slots_k].set(sub.k, mode="drop"),
                full.v.at[:, slots_k].set(sub.v, mode="drop"),
                put(full.lengths, sub.lengths),
            ),
            logits_bv=put(state.logits_bv, logits_kv),
            hidden_bd=put(state.hidden_bd, hidden_kd),
            turn_tokens_b=put(state.turn_tokens_b, zeros),
            turn_limit_b=put(state.turn_limit_b, zeros + limit),
            stop_reason_b=put(state.stop_reason_b, zeros + StopReason.RUNNING),
            recent_bw=put(state.recent_bw, jnp.full((k, state.recent_bw.shape[1]), -1, jnp.int32)),
        )
        return state, hidden_kd

    # ------------------------------------------------------------------------------------- generate
    def generate(
        self, params: nnx.State, decode_state: DecodeState, refill_after: int | None = None
    ) -> tuple[DecodeState, GenerateOutput]:
        """Decodes every ``RUNNING`` slot for up to ``steps_per_call`` steps in one device loop.

        The loop ends early when no slot is running, or once ``refill_after`` turns have ended in this call
        (so a host loop can refill freed slots at once; default: never early). Each sampled token is also
        run through the model (so the cache holds the whole turn, stop sequence included). One host copy.

        Attention cost grows with the cache positions it scans, so the loop runs on a window of the cache:
        the first ``W`` positions, ``W`` the length bucket of ``max(lengths) + steps_per_call`` (one compiled
        program per bucket), copied back in place when the call ends.
        """
        after = self.config.max_slots + 1 if refill_after is None else max(int(refill_after), 1)
        longest = int(np.max(np.asarray(decode_state.cache.lengths)))
        window = self.config.length_bucket(min(longest + self.config.steps_per_call, self.config.max_len), "window")
        state, packed = self._generate(params, decode_state, np.int32(after), window)
        out = GenerateOutput.unpack(np.asarray(packed), self.hidden_size)
        self.counters["generate_calls"] += 1
        self.counters["decode_steps"] += out.steps
        self.counters["decode_tokens"] += int(out.num_tokens.sum())
        return state, out

    def _generate_impl(self, params: nnx.State, state: DecodeState, refill_after: jax.Array, window: int):
        self.compilations["generate"] += 1
        model = nnx.merge(self.graphdef, params)
        b, n, max_len = self.config.max_slots, self.config.steps_per_call, self.config.max_len
        full = state.cache
        # No running slot can pass position `window` in this call (window >= lengths + steps, or = max_len).
        state = state._replace(cache=KVCache(full.k[:, :, :window], full.v[:, :, :window], full.lengths))
        sampling = self.config.sampling

        def step_fn(carry):
            step, st, out, num_b, ended = carry
            running_b = st.stop_reason_b == StopReason.RUNNING
            keys_b = jax.vmap(lambda data, i: jax.random.fold_in(jax.random.wrap_key_data(data), i))(
                st.keys_bk, st.sampled_b
            )
            drawn = sample(st.logits_bv, keys_b, sampling)
            token_b = jnp.where(running_b, drawn.tokens, 0)
            hidden_b1d, cache = model.hidden(token_b[:, None], st.cache, running_b.astype(jnp.int32))
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
                cache=cache,
                logits_bv=jnp.where(running_col, logits_bv, st.logits_bv),
                hidden_bd=jnp.where(running_col, hidden_b1d[:, 0].astype(jnp.float32), st.hidden_bd),
                sampled_b=st.sampled_b + grow_b,
                turn_tokens_b=turn_tokens_b,
                stop_reason_b=jnp.where(running_b, reason_b, st.stop_reason_b),
                recent_bw=recent_bw,
            )
            ended = ended + jnp.sum(running_b & (reason_b != StopReason.RUNNING))
            return step + 1, st, out, num_b + grow_b, ended

        def keep_going(carry):
            step, st, _, _, ended = carry
            return (step < n) & jnp.any(st.stop_reason_b == StopReason.RUNNING) & (ended < refill_after)

        out = (
            jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b, n), jnp.float32),
            jnp.zeros((b, n), jnp.float32),
            jnp.zeros((b, n), jnp.float32),
        )
        carry = (jnp.int32(0), state, out, jnp.zeros((b,), jnp.int32), jnp.int32(0))
        steps, state, (tokens, logprobs, sample_logprobs, entropies), num_b, _ = jax.lax.while_loop(
            keep_going, step_fn, carry
        )
        seen = state.cache
        state = state._replace(
            cache=KVCache(full.k.at[:, :, :window].set(seen.k), full.v.at[:, :, :window].set(seen.v), seen.lengths)
        )
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
    def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Marks ``slot`` idle (it stops decoding; its cache rows are reused by the next insert)."""
        return self._free(decode_state, np.int32(slot))

    def _free_impl(self, state: DecodeState, slot: jax.Array) -> DecodeState:
        self.compilations["free"] += 1
        return state._replace(
            stop_reason_b=state.stop_reason_b.at[slot].set(StopReason.IDLE),
            cache=state.cache._replace(lengths=state.cache.lengths.at[slot].set(0)),
        )

    # --------------------------------------------------------------------------------------- report
    def describe(self) -> dict[str, Any]:
        """Compiled programs per entry point and work counters, for benchmarks and logs."""
        return {"compilations": dict(self.compilations), "counters": dict(self.counters)}
