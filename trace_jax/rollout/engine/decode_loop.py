"""The ``generate`` program: up to ``steps_per_call`` decode steps of every running slot in one
``lax.while_loop``, each slot stopping on its own (stop sequence, EOS, turn limit, full cache).

Each step samples one token per running slot from its logits (greedy per slot where asked), runs it through
the model (so the cache holds the whole turn, stop sequence included) and checks the stop rules. The loop
ends when ``steps_per_call`` steps ran, no slot is running, or ``refill_after`` turns have ended (so the host
can refill freed slots at once). Attention reads each slot's first ``window`` positions through its page
table; ``window`` is static (one program per length bucket).

Everything the host needs comes back in one float32 array (ints as bit patterns), read by
``trace_jax.rollout.engine.slots.GenerateOutput.unpack``: ``[B, 4N + 3 + D]`` = tokens, log-probs, sampling
log-probs, entropies (N columns each), tokens sampled, stop reason, steps run, final hidden state; with
``EngineConfig.routing_replay``, then each sampled token's experts (N x sparse layers x top-k columns).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.config import EngineConfig
from trace_jax.rollout.engine.sampling import SamplingConfig, sample
from trace_jax.rollout.engine.slots import DecodeState, StopReason

_GREEDY = SamplingConfig.make_greedy()


def as_float(x: jax.Array) -> jax.Array:
    """int32 -> float32 bit pattern, so ints travel exactly inside the one packed float32 result array."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def decode_program(
    graphdef: nnx.GraphDef,
    config: EngineConfig,
    window: int,
    params,
    state: DecodeState,
    table_bp,
    control,
    *,
    kernel: pages.DecodeKernel | None = None,
) -> tuple[DecodeState, jax.Array]:
    """Device half of ``generate`` (the state is donated). ``table_bp``: int32 [B, P] page tables; ``control``:
    int32 [B + 1] = refill_after, then the host's running flags (a slot the host freed goes IDLE). ``kernel``:
    the engine's Pallas paged-attention plan for its mesh (None: the reference path). Returns the state and the
    packed float32 [B, 4N + 3 + D] output."""
    model = nnx.merge(graphdef, params)
    cfg = config
    record = {"record_routing": True} if cfg.routing_replay else {}
    b, n, max_len = cfg.max_slots, cfg.steps_per_call, cfg.max_len
    refill_after, host_running_b = control[0], control[1:] > 0
    # The host's running flags rule: a slot it freed without decoding (its turn never ended) goes IDLE.
    reason_b = state.stop_reason_b
    idle_b = ~host_running_b & (reason_b == StopReason.RUNNING)
    state = state._replace(stop_reason_b=jnp.where(idle_b, StopReason.IDLE, reason_b))
    # Attention reads each slot's first ``window`` positions through its page table, layer by layer.
    dtype = cfg.kv_dtype(model.config.compute_dtype)
    cache = pages.PagedKVCache(
        table_bp=table_bp, lengths=state.lengths_b, window_w=jnp.arange(window), dtype=dtype, kernel=kernel,
        **pages.pool_of(state),
    )  # fmt: skip

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
        hidden_b1d, cache, extra = model.forward_hidden(token_b[:, None], cache, running_b.astype(jnp.int32), **record)
        logits_bv = model.logits(hidden_b1d[:, 0])
        columns = (token_b, drawn.logprobs, drawn.sample_logprobs, drawn.entropies)
        if cfg.routing_replay:
            columns += (extra.experts_btlk.reshape(b, -1),)
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
    if cfg.routing_replay:
        out += (jnp.zeros((b, n, math.prod(model.config.routing_shape)), jnp.int32),)
    # The pools travel in the loop carry (as the cache), so XLA updates them in place.
    carry = (jnp.int32(0), state._replace(**dict.fromkeys(pages.POOL_FIELDS)), cache, out, jnp.zeros((b,), jnp.int32))
    carry = (*carry, jnp.int32(0))
    steps, state, cache, (tokens, logprobs, sample_logprobs, entropies, *routing), num_b, _ = jax.lax.while_loop(
        keep_going, step_fn, carry
    )
    state = state._replace(**pages.pool_of(cache))
    packed = jnp.concatenate(
        [
            as_float(tokens),
            logprobs,
            sample_logprobs,
            entropies,
            as_float(num_b)[:, None],
            as_float(state.stop_reason_b)[:, None],
            as_float(jnp.full((b, 1), steps)),
            state.hidden_bd,
            *(as_float(r.reshape(b, -1)) for r in routing),
        ],
        axis=1,
    )
    return state, packed
