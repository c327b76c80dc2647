"""The RL train step: a jit-compiled, mesh-sharded policy update with micro-batch gradient accumulation.

Usage (the wiring ``train.py`` does)::

    graphdef, params = nnx.split(model, nnx.Param)         # model built with parallel.mesh.create_sharded
    trainer = RLTrainer(graphdef, make_optimizer(cfg.optim), from_config(LossConfig, cfg.loss),
                        mesh=mesh, micro_batches=2, reference_params=params)   # the trainer keeps a copy
    state = trainer.init_state(params, jax.random.key(seed))  # takes ownership: params are donated later
    batch, info = build_batch(trees, compute_advantages("grpo", trees), BatchConfig(row_multiple=trainer.row_multiple))
    batch = trainer.prepare(state, batch)                  # fills ref log-probs (and optionally old ones)
    state, metrics = trainer.train_step(state, batch)      # metrics: dict of floats

Inside the step the policy's log-probs (and entropies) are recomputed under the current params from the
exact token ids of the batch. The loss is ``Σ_micro numerator / denominator(whole batch)`` (see
``trace_jax.rl.losses``), so any number of micro-batches gives the full-batch gradient. A non-finite loss
or gradient leaves params and optimizer state untouched, increments ``skipped_steps`` and the run goes on.

Shardings: params keep the shardings they arrive with (from their logical axes); the optimizer state
follows the params; the batch is split over the mesh's (data, fsdp) axes; step, rng and counters are
replicated. The state is donated to the step (the update is in place on device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.optim import guarded_update, init_sharded
from trace_jax.parallel.mesh import batch_sharding, traced_under
from trace_jax.rl.batch import TrainBatch
from trace_jax.rl.losses import LossConfig, LossInputs, compute_loss, finalize_metrics, loss_denominator

LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, tokens int32 [B, T]) -> logits float32 [B, T, V]


class TrainState(NamedTuple):
    """Everything the RL update carries between steps (a pytree; checkpoint it with ``_asdict()``).

    params: policy params (``nnx.State`` from ``nnx.split(model, nnx.Param)``).
    opt_state: the optax state for ``params``.
    step: int32 [] optimizer steps attempted (skipped ones included).
    rng: a typed PRNG key for whatever randomness the caller threads through training.
    skipped_steps: int32 [] steps whose update was skipped for a non-finite loss or gradient.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    skipped_steps: jax.Array


def model_logits_fn(graphdef: nnx.GraphDef) -> LogitsFn:
    """``(params, tokens) -> logits`` for a module whose call returns an object with ``logits_btv``."""

    def logits(params: Any, tokens_bt: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params)(tokens_bt).logits_btv

    return logits


def _target_stats(logits_btv: jax.Array, targets_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-prob of each target and the entropy of each distribution, float32 [B, T]."""
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    logprobs = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
    entropies = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return logprobs, entropies


def _shift_in(values_bt: jax.Array) -> jax.Array:
    """Stats of tokens 1..T-1 -> [B, T] with a 0 for token 0 (which has no context)."""
    return jnp.concatenate([jnp.zeros((values_bt.shape[0], 1), values_bt.dtype), values_bt], axis=1)


def token_logprobs(logits_fn: LogitsFn, params: Any, tokens_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of every token given the tokens before it.

    Returns ``(logprobs_bt, entropies_bt)``, float32 [B, T]; entry t is about token t predicted from
    positions < t (entry 0, which has no context, is 0). Materialises all [B, T, V] logits.
    """
    logprobs, entropies = _target_stats(logits_fn(params, tokens_bt)[:, :-1], tokens_bt[:, 1:])
    return _shift_in(logprobs), _shift_in(entropies)


def chunked_token_logprobs(
    graphdef: nnx.GraphDef, params: Any, tokens_bt: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``token_logprobs`` for a model with ``hidden(tokens) -> (hidden_btd, cache)`` and ``logits(hidden)``,
    computing the LM head ``chunk`` positions at a time and recomputing each chunk in the backward pass.

    Peak logits memory is [B, chunk, V] instead of [B, T, V] (with a 150k vocabulary the full tensor is
    the largest activation of the step). Same values as ``token_logprobs`` up to float rounding.
    """
    model = nnx.merge(graphdef, params)
    hidden_btd, _ = model.hidden(tokens_bt)
    b, t = tokens_bt.shape
    n = -(-(t - 1) // chunk)
    pad = n * chunk - (t - 1)
    hidden = jnp.pad(hidden_btd[:, :-1], ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(tokens_bt[:, 1:], ((0, 0), (0, pad)))
    hidden_nbcd = hidden.reshape(b, n, chunk, -1).swapaxes(0, 1)
    targets_nbc = targets.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(args):
        h_bcd, y_bc = args
        return _target_stats(model.logits(h_bcd), y_bc)

    logprobs, entropies = jax.lax.map(one_chunk, (hidden_nbcd, targets_nbc))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, : t - 1]
    return _shift_in(unchunk(logprobs)), _shift_in(unchunk(entropies))


class RLTrainer:
    """Builds the jit'd train step for one policy.

    Args:
      graphdef: the policy's graph definition (``nnx.split(model, nnx.Param)[0]``).
      optimizer: e.g. ``trace_jax.optim.make_optimizer(...)``.
      loss_config: what the loss does (``LossConfig``).
      mesh: device mesh with axes (data, fsdp, tensor); None runs on the default device.
      micro_batches: gradient accumulation steps per update; the batch's row count must divide by
        ``row_multiple``.
      reference_params: frozen params of the reference policy, used by ``prepare`` for the KL term.
      recompute_old_logprobs: ``prepare`` replaces the sampler's log-probs by the trainer's own under the
        current params (removes sampler/trainer numeric mismatch from the ratio).
      logits_fn: override of the forward pass (default: ``model_logits_fn(graphdef)``).
      logprob_chunk: compute the LM head this many positions at a time (``chunked_token_logprobs``; needs a
        graphdef whose model has ``hidden`` and ``logits``, as ``Qwen`` does); None: all positions at once.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef | None,
        optimizer: optax.GradientTransformation,
        loss_config: LossConfig,
        *,
        mesh: Mesh | None = None,
        micro_batches: int = 1,
        reference_params: Any = None,
        recompute_old_logprobs: bool = False,
        logits_fn: LogitsFn | None = None,
        logprob_chunk: int | None = None,
    ):
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        if graphdef is None and logits_fn is None:
            raise ValueError("RLTrainer needs a graphdef or a logits_fn")
        self.optimizer = optimizer
        self.loss_config = loss_config
        self.mesh = mesh
        self.micro_batches = micro_batches
        # A private copy: the caller's params usually become the train state, whose buffers each step donates.
        self.reference_params = None if reference_params is None else jax.tree.map(jnp.copy, reference_params)
        self.recompute_old_logprobs = recompute_old_logprobs
        if logprob_chunk is not None and (graphdef is None or logprob_chunk < 1):
            raise ValueError(f"logprob_chunk={logprob_chunk} needs a graphdef and a value >= 1")
        self.logits_fn = logits_fn or model_logits_fn(graphdef)
        if logprob_chunk is None:
            self.token_stats = lambda params, tokens: token_logprobs(self.logits_fn, params, tokens)
        else:
            self.token_stats = lambda params, tokens: chunked_token_logprobs(graphdef, params, tokens, logprob_chunk)
        self._step_fn: Any = None
        logprobs = lambda params, tokens: self.token_stats(params, tokens)[0]
        self._logprobs_fn = jax.jit(logprobs if mesh is None else traced_under(mesh, logprobs))

    # ------------------------------------------------------------------------------------ placement
    @property
    def row_multiple(self) -> int:
        """Batch rows must be a multiple of this (batch shards × micro-batches): ``BatchConfig.row_multiple``."""
        shards = 1 if self.mesh is None else self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        return shards * self.micro_batches

    def _replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def _put_batch(self, batch: TrainBatch) -> TrainBatch:
        rows = batch.tokens.shape[0]
        if rows % self.row_multiple:
            raise ValueError(
                f"batch has {rows} rows, not a multiple of {self.row_multiple} (batch shards × micro_batches); "
                "build it with BatchConfig(row_multiple=trainer.row_multiple)"
            )
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, batch)
        return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(self.mesh, np.ndim(x))), batch)

    def init_state(self, params: Any, rng: jax.Array) -> TrainState:
        """A fresh TrainState; the optimizer state is created next to (and sharded like) ``params``.

        The state takes ownership of ``params``: ``train_step`` donates them, so use ``state.params`` afterwards
        (e.g. ``nnx.merge(graphdef, state.params)`` for the rollout engine), never the arrays passed here.
        """
        replicated = self._replicated()
        if replicated is None:
            opt_state = jax.jit(self.optimizer.init)(params)
        else:
            # Born sharded: each moment takes its parameter's sharding (no whole-model copy on any device);
            # leaves that do not mirror params (step counts) are replicated over the mesh.
            opt_state = init_sharded(self.optimizer, params, replicated)
        scalar = (lambda x: jax.device_put(x, replicated)) if replicated is not None else jnp.asarray
        return TrainState(
            params=params,
            opt_state=opt_state,
            step=scalar(jnp.zeros((), jnp.int32)),
            rng=scalar(rng),
            skipped_steps=scalar(jnp.zeros((), jnp.int32)),
        )

    # -------------------------------------------------------------------------------------- logprobs
    def logprobs(self, params: Any, batch: TrainBatch) -> jax.Array:
        """float32 [B, T] log-probs of the batch's tokens under ``params`` (sharded like the batch)."""
        return self._logprobs_fn(params, self._put_batch(batch).tokens)

    def prepare(self, state: TrainState, batch: TrainBatch, recompute_old_logprobs: bool | None = None) -> TrainBatch:
        """Fills ``ref_logprobs`` (if reference params are set) and, with ``recompute_old_logprobs`` (default:
        the trainer's setting), replaces ``old_logprobs`` by the current policy's. Returns device arrays."""
        batch = self._put_batch(batch)
        recompute = self.recompute_old_logprobs if recompute_old_logprobs is None else recompute_old_logprobs
        if recompute:
            batch = batch._replace(old_logprobs=self._logprobs_fn(state.params, batch.tokens))
        if self.reference_params is not None:
            batch = batch._replace(ref_logprobs=self._logprobs_fn(self.reference_params, batch.tokens))
        elif self.loss_config.kl_coef:
            raise ValueError("loss kl_coef > 0 needs RLTrainer(reference_params=...)")
        return batch

    # ------------------------------------------------------------------------------------------ step
    def _loss_and_metrics(self, params: Any, micro: TrainBatch, denominator: jax.Array):
        logprobs, entropies = self.token_stats(params, micro.tokens)
        if not self.loss_config.entropy_coef:
            entropies = jax.lax.stop_gradient(entropies)  # reported only: keep it out of the backward pass
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=micro.old_logprobs,
            advantages=micro.advantages,
            weights=micro.weights,
            segment_ids=micro.segment_ids,
            ref_logprobs=micro.ref_logprobs,
            entropies=entropies,
        )
        out = compute_loss(inputs, self.loss_config)
        return out.numerator / denominator, out.metrics

    def _micro_batches(self, batch: TrainBatch) -> TrainBatch:
        """[B, ...] -> [M, B/M, ...]; micro-batch m takes rows m, m+M, ... so every shard holds a part of each."""
        m = self.micro_batches

        def split(x):
            x = x.reshape((x.shape[0] // m, m, *x.shape[1:])).swapaxes(0, 1)
            if self.mesh is not None:
                spec = PartitionSpec(None, *batch_sharding(self.mesh, x.ndim - 1).spec)
                x = jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
            return x

        return jax.tree.map(split, batch)

    def _step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, Any]]:
        denominator = jnp.maximum(loss_denominator(batch.weights, self.loss_config), 1e-8)
        grad_fn = jax.value_and_grad(self._loss_and_metrics, has_aux=True)

        def accumulate(carry, micro):
            loss_sum, grads_sum, metrics_sum = carry
            (loss, metrics), grads = grad_fn(state.params, micro, denominator)
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            metrics_sum = jax.tree.map(jnp.add, metrics_sum, metrics)
            return (loss_sum + loss, grads_sum, metrics_sum), None

        micros = self._micro_batches(batch)
        first = jax.tree.map(lambda x: x[0], micros)
        metric_shapes = jax.eval_shape(lambda p, b: self._loss_and_metrics(p, b, denominator)[1], state.params, first)
        zeros = (
            jnp.zeros((), jnp.float32),
            jax.tree.map(jnp.zeros_like, state.params),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes),
        )
        (loss, grads, metrics), _ = jax.lax.scan(accumulate, zeros, micros)
        update = guarded_update(self.optimizer, grads, state.opt_state, state.params, loss)
        new_state = TrainState(
            params=update.params,
            opt_state=update.opt_state,
            step=state.step + 1,
            rng=state.rng,
            skipped_steps=state.skipped_steps + (~update.finite).astype(jnp.int32),
        )
        out = {
            "loss": loss,
            "grad_norm": update.grad_norm,
            "update_applied": update.finite,
            "skipped_steps": new_state.skipped_steps,
            "pairs": metrics,
        }
        return new_state, out

    def _compile(self, state: TrainState) -> Any:
        if self.mesh is None:
            return jax.jit(self._step, donate_argnums=0)
        # Inputs arrive placed (params by their logical axes, batch by _put_batch); pin the outputs to the
        # same layout so the state keeps its shardings step after step.
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        # Traced under the mesh so the model's activation constraints (parallel.mesh.constrain) apply.
        step = traced_under(self.mesh, self._step)
        return jax.jit(step, out_shardings=(state_shardings, self._replicated()), donate_argnums=0)

    def train_step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict[str, float]]:
        """One optimizer update on ``batch`` (host or device arrays; see ``prepare`` for ref/old log-probs).

        Returns the new state (the old one is donated: do not reuse it) and host metrics: loss, grad_norm,
        update_applied (1.0 or 0.0), skipped_steps, and every loss metric (pg_loss, clip_fraction, approx_kl,
        ratio, entropy, kl_ref, ...) averaged over trained tokens by their weights.
        """
        if self.loss_config.kl_coef and batch.ref_logprobs is None:
            raise ValueError("loss kl_coef > 0 but the batch has no ref_logprobs; call trainer.prepare(state, batch)")
        batch = self._put_batch(batch)
        if self._step_fn is None:
            self._step_fn = self._compile(state)
        state, out = self._step_fn(state, batch)
        out = jax.device_get(out)
        metrics = finalize_metrics(out.pop("pairs"))
        metrics.update({k: float(v) for k, v in out.items()})
        return state, metrics
