"""Per-token log-probs (and, when asked, entropies) of training rows, never materialising [rows, T, V].

A token's log-prob comes from the final hidden state of its predecessor on its path (``batch.predecessor``:
the parent node's last token for a node's first token in a packed tree row; ``t - 1`` in a path row). The
LM head and the softmax over the vocabulary run ``chunk`` positions at a time under ``jax.checkpoint``, so
the backward pass recomputes one chunk's logits instead of storing all of them: peak logits memory is
[rows, chunk, V]. The entropy (a second pass over the vocabulary per position) is computed only on request.
The trainer asks only for the tokens a batch trains (``trained_only``): those move to the front of their row
and the chunks past them are skipped, so the head runs over the trained share of a row (about a fifth on the
default world), not over its prompts, observations and padding.

Needs a model with ``forward_hidden(tokens, positions_bt=..., kv_visible_end_bt=..., token_mask_bt=...) ->
(hidden_btd, _, extra)`` and ``logits(hidden) -> float32 [..., V]``, as ``trace_jax.models.qwen.Qwen``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.rollout.engine.sampling import SamplingConfig, token_sample_logprobs

DEFAULT_CHUNK = 128


def predecessor_forward(model: Any, batch: Any) -> tuple[jax.Array, Any]:
    """``(hidden [B, T, D], extra)``: the final hidden state that predicts each token (its predecessor's on its
    path) and what the layers report besides (a mixture of experts' router statistics over the rows' real
    tokens; None for a dense model). A batch with a ``routing`` record (``TrainBatch.routing``) replays it in a
    mixture of experts' forward."""
    replay = {} if getattr(batch, "routing", None) is None else {"routing_btlk": batch.routing}
    real_bt = jnp.arange(batch.tokens.shape[1])[None, :] < batch.lengths[:, None]
    hidden_btd, _, extra = model.forward_hidden(
        batch.tokens,
        positions_bt=batch.positions,
        kv_visible_end_bt=batch.visible_end,
        token_mask_bt=real_bt,
        **replay,
    )
    return jnp.take_along_axis(hidden_btd, batch.predecessor[..., None], axis=1), extra


def predecessor_hidden(model: Any, batch: Any) -> jax.Array:
    """[B, T, D]: the final hidden state that predicts each token (``predecessor_forward``'s first half)."""
    return predecessor_forward(model, batch)[0]


def map_chunks(
    fn: Callable[[jax.Array, jax.Array], dict[str, jax.Array]],
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    chunk: int,
    needed_bt: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """``fn(hidden [B, C, D], targets [B, C]) -> {name: [B, C]}`` over ``chunk``-position slices, each
    rematerialised in the backward pass; returns {name: [B, T]}.

    With ``needed_bt`` (bool [B, T]) only the needed positions are computed and the others get 0: each row's
    needed positions move to its front (in order), and a chunk past every row's last needed one is skipped,
    in the backward pass too. A row that trains a fifth of its positions runs ``fn`` over about a fifth of
    its chunks."""
    if needed_bt is None:
        return _over_chunks(fn, hidden_btd, targets_bt, chunk)
    order = jnp.argsort(jnp.logical_not(needed_bt), axis=1, stable=True)  # needed first, in row order
    front = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
    live = jnp.max(jnp.sum(needed_bt, axis=1))
    out = _over_chunks(fn, front(hidden_btd), front(targets_bt), chunk, live=live)
    back = jnp.argsort(order, axis=1)
    return jax.tree.map(lambda x: jnp.where(needed_bt, jnp.take_along_axis(x, back, axis=1), 0.0), out)


def _over_chunks(
    fn: Callable[[jax.Array, jax.Array], dict[str, jax.Array]],
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    chunk: int,
    live: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """``map_chunks`` over every position, or (``live``) over the chunks that start before position ``live``,
    0 in the others."""
    b, t = targets_bt.shape
    chunk = max(1, min(chunk, t))
    n = -(-t // chunk)
    pad = n * chunk - t
    hidden = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
    targets = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
    if live is None:
        out = jax.lax.map(jax.checkpoint(lambda args: fn(*args)), (hidden, targets))
    else:
        zeros = lambda *args: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))
        # Checkpointed outside the cond, the scan keeps a chunk's inputs, never a branch's residuals (which
        # would stack [n, rows, chunk, V]); inside it, the cond hands its backward those inputs, not the logits.
        body = jax.checkpoint(lambda args: jax.lax.cond(args[2] < live, jax.checkpoint(fn), zeros, *args[:2]))
        out = jax.lax.map(body, (hidden, targets, jnp.arange(n) * chunk))
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t], out)


def _needed(batch: Any, trained_only: bool) -> jax.Array | None:
    """``map_chunks``' needed positions: the tokens the batch trains, or None (every position)."""
    return batch.weights > 0 if trained_only else None


def _has_context(batch: Any) -> jax.Array:
    return batch.predecessor != jnp.arange(batch.tokens.shape[1])[None, :]


def policy_forward(
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Any,
    *,
    chunk: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
    entropy: bool = False,
    trained_only: bool = False,
) -> tuple[jax.Array, jax.Array | None, Any]:
    """``(logprobs_bt, entropies_bt or None, extra)``: float32 [B, T] log-probs (and entropies, when asked) of
    the policy ``softmax(logits / temperature)``, and the forward's ``extra`` (``predecessor_forward``: a
    mixture of experts' router statistics, for its load-balancing loss; None for a dense model).

    ``batch`` has ``tokens``, ``positions``, ``visible_end`` and ``predecessor`` ([B, T] int32) and ``lengths``
    ([B]), as ``TrainBatch``. Tokens without context (a prompt's first token, padding) get 0; with
    ``trained_only`` so do the tokens the batch does not train (``weights`` 0), whose LM head is not run
    (``map_chunks``' needed positions). Differentiable.
    """
    model = nnx.merge(graphdef, params)

    def stats(h_bcd: jax.Array, y_bc: jax.Array) -> dict[str, jax.Array]:
        logits = model.logits(h_bcd) / temperature
        lse = jax.nn.logsumexp(logits, axis=-1)
        out = {"logprobs": jnp.take_along_axis(logits, y_bc[..., None], axis=-1)[..., 0] - lse}
        if entropy:
            out["entropies"] = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return out

    hidden_btd, extra = predecessor_forward(model, batch)
    out = map_chunks(stats, hidden_btd, batch.tokens, chunk, _needed(batch, trained_only))
    keep = _has_context(batch)
    mask = lambda x: jnp.where(keep, x, 0.0)
    return mask(out["logprobs"]), mask(out["entropies"]) if entropy else None, extra


def policy_logprobs(
    graphdef: nnx.GraphDef, params: Any, batch: Any, **options: Any
) -> tuple[jax.Array, jax.Array | None]:
    """``(logprobs_bt, entropies_bt or None)`` of ``policy_forward`` (same keywords: chunk, temperature,
    entropy), without the forward's ``extra``."""
    return policy_forward(graphdef, params, batch, **options)[:2]


def behaviour_logprobs(
    graphdef: nnx.GraphDef,
    params: Any,
    batch: Any,
    sampling: SamplingConfig,
    *,
    chunk: int = DEFAULT_CHUNK,
    trained_only: bool = False,
) -> jax.Array:
    """float32 [B, T]: log-probs of the tokens under the sampling distribution (``sampling``'s temperature,
    top-k and top-p applied to ``params``' logits, exactly as the sampler does); ``trained_only`` as in
    ``policy_forward``. Not for differentiation."""
    model = nnx.merge(graphdef, params)

    def stats(h_bcd: jax.Array, y_bc: jax.Array) -> dict[str, jax.Array]:
        b, c = y_bc.shape
        logits = model.logits(h_bcd).reshape(b * c, -1)
        return {"logprobs": token_sample_logprobs(logits, y_bc.reshape(-1), sampling).reshape(b, c)}

    out = map_chunks(stats, predecessor_hidden(model, batch), batch.tokens, chunk, _needed(batch, trained_only))
    return jnp.where(_has_context(batch), out["logprobs"], 0.0)
