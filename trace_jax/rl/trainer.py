"""The RL update: PPO epochs × mini-batches over one rollout batch, each mini-batch one mesh-sharded
optimizer step whose gradient accumulates over fixed-shape micro-batches.

Usage (the wiring ``trace_jax.job.training`` does)::

    graphdef, params = nnx.split(model, nnx.Param)         # model built with parallel.mesh.create_sharded
    trainer = RLTrainer(graphdef, make_optimizer(schema.optimizer_config(run)), run.loss,   # run: a RunConfig
                        mesh=mesh, update=run.ppo, sampling=engine.sampling,
                        reference_params=params if run.loss.kl_coef else None)   # the trainer keeps a copy
    check_objective(run.rl.advantage, trainer.loss_config, batch_config)   # at config time
    state = trainer.init_state(params, jax.random.key(seed))  # takes ownership: params are donated later
    batch, info = build_batch(trees, compute_advantages("grpo", trees),
                              BatchConfig(fixed_length=True), trainer.loss_config)   # no padding rows needed
    state, metrics = trainer.update(state, batch)          # metrics: dict of floats (ratio stats included)

Inside a step the policy's log-probs are recomputed under the current params from the exact token ids of
the batch (``trace_jax.rl.logprobs``: packed rows, chunked LM head, run over the trained tokens only), as
log-probs of the *sampling* temperature's policy ``softmax(logits / T)``; the entropy over the vocabulary only
when ``entropy_coef != 0`` or ``UpdateConfig.entropy_metric``; reference log-probs only when ``kl_coef != 0``.
The loss of a mini-batch is ``Σ_micro numerator / denominator(whole rollout batch)`` (see
``trace_jax.rl.losses``), so any number of micro-batches gives the mini-batch gradient, and the mini-batches of
an epoch sum to the full-batch objective (a shared-prefix token carries paths whose leaves are in other
mini-batches: a mini-batch's own path count would misweigh it).

Programs. ``update`` cuts every mini-batch into micro-batches of exactly ``UpdateConfig.micro_rows`` rows
(the last padded with weight-0 rows) and runs three programs whose shapes never change: zero accumulators,
accumulate one micro-batch's gradient, apply the optimizer. With a fixed row length
(``BatchConfig.fixed_length``) a run therefore compiles its update once, at the first step, whatever the
size of later batches (``programs`` lists what was compiled; ``update`` logs its size as ``programs``).
Behaviour and reference log-probs run over the same fixed micro-batches.
A non-finite loss or gradient leaves params and optimizer state untouched, increments ``skipped_steps``
and the run goes on.

A mixture of experts' load-balancing loss (``LossConfig.router_aux_loss_coef``) is pooled over an optimizer
step's tokens, not a micro-batch's: before the step's gradient a forward over its micro-batches (no LM head)
counts its top-k choices per expert (``RouterCounts``), and each micro-batch adds its router probabilities'
part of ``E sum_e f_e P_e`` with the step's f_e, so the parts sum to the step's loss in value and gradient
(transformers' ``load_balancing_loss_func`` over the step's non-padding tokens). The logged
``router_aux_loss`` is that pooled value, averaged over steps.

Shardings: params keep the shardings they arrive with (from their logical axes); the optimizer state
follows the params; the batch is split over the mesh's (data, fsdp) axes; step, rng and counters are
replicated. The state is donated to the step (the update is in place on device).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.config_utils import documented
from trace_jax.models import lora
from trace_jax.models.moe import RouterStats, router_aux_loss
from trace_jax.models.qwen import REMAT_POLICIES
from trace_jax.optim import guarded_update, init_sharded
from trace_jax.parallel import multihost
from trace_jax.parallel.mesh import traced_under
from trace_jax.parallel.slices import per_slice, slice_count, stacked_sharding
from trace_jax.rl.batch import TrainBatch, take_rows
from trace_jax.rl.logprobs import DEFAULT_CHUNK, behaviour_logprobs, policy_forward, predecessor_forward
from trace_jax.rl.losses import (
    LossConfig,
    LossInputs,
    combine_metrics,
    compute_loss,
    finalize_metrics,
    loss_denominator,
)
from trace_jax.rl.sequences import PathTokens, sequence_terms
from trace_jax.rollout.engine.sampling import SamplingConfig

# Where the behaviour ("old") log-probs of PPO's ratio come from (see ``UpdateConfig``).
BEHAVIOUR_LOGPROBS = ("sampler", "recompute", "untruncated")
# The TPU compiler's switches for windowed (collective) matmuls over an all-gather and over a reduce-scatter.
WINDOWED_EINSUM_FLAGS = (
    "xla_tpu_enable_windowed_einsum_for_all_gather",
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter",
)


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How one rollout batch updates the policy (PPO's outer loop)."""

    ppo_epochs: int = documented(
        2,
        "passes over the rollout batch; each pass after the first trains on data the policy has already moved away "
        "from, which is where the clip acts.",
    )
    mini_batches: int = documented(
        2,
        "optimizer steps per epoch; the rows are reshuffled every epoch and split into this many mini-batches, each "
        "divided by the whole batch's denominator (so the mini-batch losses of an epoch sum to the full-batch "
        "objective). ppo_epochs × mini_batches steps per rollout batch (``steps_per_batch``).",
    )
    behaviour_logprobs: str = documented(
        "sampler",
        'the "old" log-probs of the ratio. "sampler": the sampler\'s ``sample_logprobs``, the log-probs of the '
        'distribution the tokens were actually drawn from (tempered, top-k / top-p truncated); "recompute": the '
        "trainer recomputes them in float32 before the first step under the same transform (temperature, top-k, top-p: "
        "``RLTrainer(sampling=...)``), removing the sampler's numeric mismatch (e.g. bf16 decoding). Either way the "
        "trained policy is the tempered one, ``softmax(logits / temperature)``; at the first step the ratio is "
        '``π_T(y) / π_T,truncated(y) <= 1``, the mass top-k / top-p kept at that position. "untruncated": the trainer '
        "recomputes them in float32 under the trained policy's own distribution ``softmax(logits / temperature)`` (no "
        "top-k / top-p), so the first step's ratio is 1 whatever the truncation (the ratio then measures the policy's "
        "move only, not the sampler's truncation). Recomputed log-probs are those of the params that sampled the "
        "batch: ``prepare(..., behaviour_params=...)`` when the rollouts lag the trained params "
        "(``rl.max_staleness``).",
    )
    entropy_metric: bool = documented(
        False,
        "compute (and log) the policy entropy even when ``entropy_coef`` is 0 (costs a pass over the vocabulary per "
        "position).",
    )
    micro_rows: int = documented(
        8,
        "rows per forward/backward call; every call has this shape, so the update compiles once. Sets the activation "
        "memory; must be a multiple of the batch shards (data × fsdp × expert). 0: one row per batch shard "
        "(``RLTrainer.micro_rows``), the smallest call, which also pads the fewest rows.",
    )
    shuffle_seed: int = documented(0, "seed of the per-epoch row shuffles (combined with the state's step).")
    remat: str = documented(
        "",
        "what the update's layer scan keeps for the backward pass, a key of ``trace_jax.models.qwen.REMAT_POLICIES`` "
        '("none", "save_dots", "full": less kept, less activation memory, more recompute); "": the model\'s own '
        "(``ModelConfig.remat``). Only the update: sampling has no backward pass. ``launch/tpu_pod.sh --plan-layout`` "
        "sets it with the mesh and ``micro_rows`` the plan picks.",
    )
    windowed_einsum: bool = documented(
        True,
        "let the TPU compiler window the update's sharded matmuls (its default): a matmul whose weight is "
        "all-gathered, or whose output is reduce-scattered, runs as a loop over the shards that overlaps each "
        "transfer with a partial product and keeps the partial sums in HBM. False compiles the update without it "
        "(plain all-gathers and reduce-scatters, which the compiler still overlaps with other work): on a v5p-64 "
        "fsdp-32 Qwen3-8B update the loop's partial sums made the program HBM-bound, 1.70 TB a call against 0.60 "
        "TB without (``docs/tpu_speed.md``). TPU only; other compilers have no such loop. "
        "``launch/tpu_pod.sh --plan-layout`` sets it from the plan.",
    )

    def __post_init__(self):
        if self.micro_rows < 0:
            raise ValueError(f"micro_rows must be >= 1, or 0 for one row per batch shard; got {self.micro_rows}")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ValueError(f"ppo_epochs and mini_batches must be >= 1, got {self.ppo_epochs}, {self.mini_batches}")
        if self.behaviour_logprobs not in BEHAVIOUR_LOGPROBS:
            raise ValueError(
                f"unknown behaviour_logprobs {self.behaviour_logprobs!r}; choose one of {BEHAVIOUR_LOGPROBS}"
            )
        if self.remat and self.remat not in REMAT_POLICIES:
            raise ValueError(
                f'unknown remat {self.remat!r}; choose one of {sorted(REMAT_POLICIES)}, or "" (the model\'s)'
            )

    def compiler_options(self, platform: str) -> dict[str, bool] | None:
        """The update's compiler options on ``platform`` (``jax.jit(compiler_options=...)``): the TPU compiler's
        windowed-einsum switches off when ``windowed_einsum`` is False; None (the compiler's defaults) else."""
        if platform != "tpu" or self.windowed_einsum:
            return None
        return dict.fromkeys(WINDOWED_EINSUM_FLAGS, False)

    def trained_model(self, model_config: Any) -> Any:
        """``model_config`` as the update runs it: with this config's ``remat`` when one is set."""
        return dataclasses.replace(model_config, remat=self.remat) if self.remat else model_config

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps ``RLTrainer.update`` makes on one rollout batch: ppo_epochs × mini_batches (a batch
        with fewer rows holding tokens than ``mini_batches`` makes one step per such row and epoch instead)."""
        return self.ppo_epochs * self.mini_batches


class RouterCounts(NamedTuple):
    """An optimizer step's routing counts, fixed before its gradient (``RLTrainer.router_counts``): ``chosen_e``
    float32 [E] top-k choices of expert e and ``rows`` float32 [] (token, sparse layer) rows, over every
    non-padding token of the step's rows; ``scale`` float32 [] the load-balancing loss's weight in the step's loss
    (``LossConfig.router_aux_loss_coef`` / optimizer steps per epoch)."""

    chosen_e: jax.Array
    rows: jax.Array
    scale: jax.Array


def _router_stat_metrics(metrics: dict[str, Any], stats: RouterStats) -> dict[str, Any]:
    """``metrics`` with a micro-batch's router statistics as summable pairs (vectors, combined by addition over
    the step's micro-batches; ``_pooled_router_aux_loss`` turns them into the step's loss)."""
    stats = jax.tree.map(jax.lax.stop_gradient, stats)
    return {**metrics, "router_chosen": (stats.chosen_e, stats.tokens), "router_prob": (stats.prob_e, stats.tokens)}


def _pooled_router_aux_loss(pairs: dict[str, Any]) -> dict[str, Any]:
    """The step's metric pairs with its summed router statistics replaced by the load-balancing loss of the
    whole step, ``router_aux_loss`` as a (value, 1) pair: pooled over its tokens as transformers pools over a
    batch, and averaged over steps when steps combine."""
    if "router_chosen" not in pairs:
        return pairs
    pairs = dict(pairs)
    (chosen_e, rows), (prob_e, _) = pairs.pop("router_chosen"), pairs.pop("router_prob")
    aux = router_aux_loss(RouterStats(chosen_e, prob_e, rows))
    return {**pairs, "router_aux_loss": (aux, jnp.ones((), jnp.float32))}


def _step_router_aux_loss(stats: RouterStats, counts: RouterCounts) -> jax.Array:
    """One micro-batch's part of ``scale x`` the step's load-balancing loss ``E sum_e f_e P_e``: f_e (the step's
    share of top-k choices, a constant of the gradient as in transformers) from ``counts``, and this micro-batch's
    router probabilities summed over its real tokens over the step's rows; the parts of a step sum to exactly
    ``scale x router_aux_loss(the step's statistics)`` in value and gradient."""
    rows = jnp.maximum(counts.rows, 1.0)
    return counts.scale * stats.chosen_e.shape[0] * jnp.sum((counts.chosen_e / rows) * (stats.prob_e / rows))


def _sum_slices(acc: Any) -> Any:
    """Per-slice accumulators (loss, grads, metric pairs; leading slice axis) as one: summed, ``*_max`` by max."""
    loss, grads, metrics = acc
    reduce = lambda key: jnp.max if key.endswith("_max") else jnp.sum
    pooled = {k: tuple(reduce(k)(x, axis=0) for x in pair) for k, pair in metrics.items()}
    return jnp.sum(loss, axis=0), jax.tree.map(lambda g: jnp.sum(g, axis=0), grads), pooled


def _nonfinite_behaviour_tokens(batch: TrainBatch) -> float:
    """Trained tokens of ``batch`` whose behaviour log-prob is −inf or NaN (the loss leaves them out)."""
    old = np.asarray(multihost.to_host(batch.old_logprobs))
    return float(np.sum((np.asarray(multihost.to_host(batch.weights)) > 0) & ~np.isfinite(old)))


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


class RLTrainer:
    """Builds the jit'd update programs (``update``) for one policy.

    Args:
      graphdef: the policy's graph definition (``nnx.split(model, nnx.Param)[0]``); its model must have
        ``hidden`` (with packed-row arguments) and ``logits``, as ``Qwen`` does.
      optimizer: e.g. ``trace_jax.optim.make_optimizer(...)``. The update differentiates and steps
        ``lora.trained_part(params)``: all of them, or a LoRA policy's adapters alone (its optimizer then one whose
        state covers only them, ``lora.frozen_base``); the frozen base gets no gradient and no accumulator.
      loss_config: what the loss does (``LossConfig``).
      mesh: device mesh with axes (data, fsdp, tensor); None runs on the default device.
      reference_params: frozen params of the reference policy (needed when ``kl_coef != 0``, unused otherwise).
      update: PPO epochs / mini-batches / behaviour log-probs (``UpdateConfig``; default ``UpdateConfig()``).
      sampling: the transform rollouts were sampled with (temperature for the trained policy; temperature,
        top-k, top-p for recomputed behaviour log-probs); default ``SamplingConfig()`` (T = 1, no truncation).
      logprob_chunk: positions per LM-head chunk (peak logits memory [rows, chunk, V]).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: optax.GradientTransformation,
        loss_config: LossConfig,
        *,
        mesh: Mesh | None = None,
        reference_params: Any = None,
        update: UpdateConfig | None = None,
        sampling: SamplingConfig | None = None,
        logprob_chunk: int = DEFAULT_CHUNK,
    ):
        if logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {logprob_chunk}")
        update = update or UpdateConfig()
        self.graphdef = graphdef
        self.optimizer = optimizer
        self.loss_config = loss_config
        self.mesh = mesh
        self.update_config = update
        self.sampling = sampling or SamplingConfig()
        if self.sampling.greedy:
            raise ValueError("RLTrainer needs the sampling transform of sampled rollouts (temperature > 0), not greedy")
        self.logprob_chunk = logprob_chunk
        # A private copy: the caller's params usually become the train state, whose buffers each step donates.
        keep_reference = reference_params is not None and loss_config.kl_coef
        self.reference_params = jax.tree.map(jnp.copy, reference_params) if keep_reference else None
        self._update_fns: dict[str, Any] | None = None
        self.programs: set[tuple[str, tuple[int, ...]]] = set()  # (program, micro-batch shape) run so far
        # Traced under the mesh (when there is one) so the model's activation constraints apply.
        self._under_mesh = (lambda fn: fn) if mesh is None else (lambda fn: traced_under(mesh, fn))
        self._logprobs_fn = jax.jit(self._under_mesh(self._policy_logprobs))
        self._behaviour_fn = jax.jit(self._under_mesh(self._behaviour_logprobs))
        self._counts_fn = jax.jit(self._under_mesh(self._router_counts))
        # Recomputed behaviour log-probs by ``behaviour_logprobs``: (program name, program).
        self._recomputed_behaviour = {
            "recompute": ("behaviour", self._behaviour_fn),
            "untruncated": ("logprobs", self._logprobs_fn),
        }

    # ------------------------------------------------------------------------------------ placement
    @property
    def micro_rows(self) -> int:
        """Rows per forward/backward call of ``update``: ``UpdateConfig.micro_rows``, or with 0 one per batch shard."""
        return self.update_config.micro_rows or self.batch_shards

    @property
    def batch_shards(self) -> int:
        """Shards the rows of a micro-batch split into: the mesh's (slice, data, fsdp, expert) axes
        (``trace_jax.parallel.mesh``'s "batch" axis); 1 without a mesh."""
        axes = ("slice", "data", "fsdp", "expert")
        return 1 if self.mesh is None else int(np.prod([self.mesh.shape.get(a, 1) for a in axes]))

    def _replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

    def _put_batch(self, batch: TrainBatch) -> TrainBatch:
        """The host ``batch`` on the devices, its rows split over the batch shards (a multiple of them)."""
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, batch)
        return multihost.rows_to_global(batch, self.mesh)  # each process feeds the rows its devices hold

    def init_state(self, params: Any, rng: jax.Array) -> TrainState:
        """A fresh TrainState; the optimizer state is created next to (and sharded like) ``params``.

        The state takes ownership of ``params``: ``update`` donates them, so use ``state.params`` afterwards
        (e.g. ``nnx.merge(graphdef, state.params)`` for the rollout engine), never the arrays passed here.
        """
        replicated = self._replicated()
        if replicated is None:
            opt_state = jax.jit(self.optimizer.init)(params)
        else:
            # Born sharded: each moment takes its parameter's sharding (no whole-model copy on any device);
            # leaves that do not mirror params (step counts) are replicated over the mesh.
            opt_state = init_sharded(self.optimizer, params, replicated)
        # Through jit, not device_put: a typed PRNG key cannot be device_put onto other hosts' devices.
        scalar = jax.jit(lambda x: x, out_shardings=replicated) if replicated is not None else jnp.asarray
        return TrainState(
            params=params,
            opt_state=opt_state,
            step=scalar(jnp.zeros((), jnp.int32)),
            rng=scalar(rng),
            skipped_steps=scalar(jnp.zeros((), jnp.int32)),
        )

    # -------------------------------------------------------------------------------------- logprobs
    def _policy_stats(self, params: Any, batch: TrainBatch, entropy: bool) -> tuple[jax.Array, jax.Array | None, Any]:
        return policy_forward(
            self.graphdef,
            params,
            batch,
            chunk=self.logprob_chunk,
            temperature=self.sampling.temperature,
            entropy=entropy,
            trained_only=True,
        )

    def _policy_logprobs(self, params: Any, batch: TrainBatch) -> jax.Array:
        return self._policy_stats(params, batch, entropy=False)[0]

    def _behaviour_logprobs(self, params: Any, batch: TrainBatch) -> jax.Array:
        return behaviour_logprobs(
            self.graphdef, params, batch, self.sampling, chunk=self.logprob_chunk, trained_only=True
        )

    def _micro(self, batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
        """Rows ``rows`` of the host ``batch`` as one placed micro-batch of exactly ``micro_rows`` rows."""
        count = self.micro_rows
        if count % self.batch_shards:
            raise ValueError(
                f"ppo.micro_rows={count} must be a multiple of the batch shards (slices × data × fsdp × expert = "
                f"{self.batch_shards})"
            )
        return self._put_batch(take_rows(batch, rows, count))

    def _map_rows(self, name: str, fn: Any, params: Any, batch: TrainBatch) -> np.ndarray:
        """float32 [B, T] host: ``fn(params, micro)`` over fixed-shape micro-batches of ``batch``'s rows that
        hold tokens (0 on rows without: they have no context)."""
        batch = jax.tree.map(multihost.to_host, batch)  # whole rows on every process
        out = np.zeros(np.asarray(batch.tokens).shape, np.float32)
        real = np.flatnonzero(np.asarray(batch.lengths) > 0)
        count = self.micro_rows
        for start in range(0, real.size, count):
            part = real[start : start + count]
            micro = self._micro(batch, part)
            self.programs.add((name, micro.tokens.shape))
            out[part] = multihost.to_host(fn(params, micro))[: part.size]  # rows may span other hosts
        return out

    def logprobs(self, params: Any, batch: TrainBatch) -> np.ndarray:
        """float32 [B, T] (host) log-probs of the tokens the batch trains (``weights`` > 0) under ``params``'
        tempered policy; 0 on the others, whose LM head is not run (every log-prob the trainer computes is so)."""
        return self._map_rows("logprobs", self._logprobs_fn, params, batch)

    @property
    def truncated_behaviour(self) -> bool:
        """Whether the behaviour log-probs are those of a top-k / top-p truncated distribution (the sampler's, or
        recomputed under the sampling transform): ``approx_kl`` then uses the estimator that stays unbiased
        (``trace_jax.rl.losses.behaviour_kl_estimate``)."""
        truncates = self.sampling.top_k > 0 or self.sampling.top_p < 1.0
        return truncates and self.update_config.behaviour_logprobs != "untruncated"

    @property
    def recomputes_behaviour(self) -> bool:
        """Whether ``prepare`` recomputes the behaviour log-probs (``behaviour_logprobs`` "recompute" or
        "untruncated"): then a batch sampled by older weights than the state's needs those weights
        (``prepare(..., behaviour_params=...)``)."""
        return self.update_config.behaviour_logprobs in self._recomputed_behaviour

    def prepare(
        self,
        state: TrainState,
        batch: TrainBatch,
        recompute_old_logprobs: bool | None = None,
        behaviour_params: Any = None,
    ) -> TrainBatch:
        """Host batch with its behaviour log-probs (recomputed as ``UpdateConfig.behaviour_logprobs`` says; asked
        here, True recomputes them, under the sampling transform when the config says "sampler", and False
        keeps the sampler's) and, when ``kl_coef != 0``, the reference log-probs; both computed over
        fixed-shape micro-batches of ``micro_rows`` rows.

        ``behaviour_params``: the params that sampled the batch, when they are not ``state.params`` (rollouts
        sampled one step ahead, ``rl.max_staleness >= 1``): recomputed behaviour log-probs are those of the
        policy that sampled, so the ratio measures the lag. None: the batch was sampled by ``state.params``.
        Unused when the sampler's log-probs are kept."""
        batch = jax.tree.map(multihost.to_host, batch)  # whole rows on every process
        mode = self.update_config.behaviour_logprobs
        if recompute_old_logprobs is not None:
            mode = ("recompute" if mode == "sampler" else mode) if recompute_old_logprobs else "sampler"
        trained = np.asarray(batch.weights) > 0
        if mode in self._recomputed_behaviour:
            sampled_by = state.params if behaviour_params is None else behaviour_params
            old = self._map_rows(*self._recomputed_behaviour[mode], sampled_by, batch)
            batch = batch._replace(old_logprobs=np.where(trained, old, 0.0).astype(np.float32))
        if self.loss_config.kl_coef:
            if self.reference_params is None:
                raise ValueError("loss kl_coef > 0 needs RLTrainer(reference_params=...)")
            if batch.ref_logprobs is None:
                batch = batch._replace(ref_logprobs=self.logprobs(self.reference_params, batch))
        return batch

    # ------------------------------------------------------------------------------------------ step
    def _loss_and_metrics(
        self, params: Any, micro: TrainBatch, denominator: jax.Array, counts: RouterCounts | None = None
    ):
        entropy = bool(self.loss_config.entropy_coef) or self.update_config.entropy_metric
        logprobs, entropies, extra = self._policy_stats(params, micro, entropy)
        if entropies is not None and not self.loss_config.entropy_coef:
            entropies = jax.lax.stop_gradient(entropies)  # reported only: keep it out of the backward pass
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=micro.old_logprobs,
            adv_pos=micro.adv_pos,
            adv_neg=micro.adv_neg,
            weights=micro.weights,
            segment_ids=micro.segment_ids,
            ref_logprobs=micro.ref_logprobs if self.loss_config.kl_coef else None,
            entropies=entropies,
            seq_loss=micro.seq_loss,
            seq_grad=micro.seq_grad,
        )
        out = compute_loss(inputs, self.loss_config, truncated_behaviour=self.truncated_behaviour)
        loss, metrics = out.numerator / denominator, out.metrics
        stats = getattr(extra, "stats", None)  # a mixture of experts' router statistics
        if stats is not None:
            metrics = _router_stat_metrics(metrics, stats)
            if counts is not None:  # an additive term: not divided by the policy loss's denominator
                loss = loss + _step_router_aux_loss(stats, counts)
        return loss, metrics

    def _router_counts(self, params: Any, micro: TrainBatch) -> tuple[jax.Array, jax.Array] | None:
        """(top-k choices per expert [E], rows []) of one micro-batch's forward (no LM head, no gradient), or
        None for a dense policy."""
        _, extra = predecessor_forward(nnx.merge(self.graphdef, params), micro)
        stats = getattr(extra, "stats", None)
        return None if stats is None else (stats.chosen_e, stats.tokens)

    def router_counts(self, params: Any, micros: list[TrainBatch], scale: float) -> RouterCounts | None:
        """The routing counts of an optimizer step over micro-batches ``micros`` at ``params`` (a forward each),
        with weight ``scale``; None when the load-balancing loss is off or the policy is dense."""
        if not self.loss_config.router_aux_loss_coef:
            return None
        total = None
        for micro in micros:
            self.programs.add(("router_counts", micro.tokens.shape))
            part = self._counts_fn(params, micro)
            if part is None:
                return None
            total = part if total is None else jax.tree.map(jnp.add, total, part)
        return RouterCounts(*total, jnp.float32(scale))

    def _zero_acc(self, params: Any, micro: TrainBatch) -> tuple[jax.Array, Any, dict[str, Any]]:
        """Accumulators (loss, grads like ``params``, metric pairs) for one optimizer step, all zero; on several
        slices each leaf has a leading slice axis (each slice's partial sums, reduced once by ``_apply``)."""
        zeros = self._zero_one_acc(params, micro)
        slices = slice_count(self.mesh)
        return zeros if slices == 1 else jax.tree.map(lambda x: jnp.broadcast_to(x, (slices, *x.shape)), zeros)

    def _zero_one_acc(self, params: Any, micro: TrainBatch) -> tuple[jax.Array, Any, dict[str, Any]]:
        metric_shapes = jax.eval_shape(lambda p, b: self._loss_and_metrics(p, b, 1.0)[1], params, micro)
        return (
            jnp.zeros((), jnp.float32),
            jax.tree.map(jnp.zeros_like, lora.trained_part(params)),
            {
                k: tuple(jnp.full(s.shape, -jnp.inf if k.endswith("_max") else 0.0, s.dtype) for s in pair)
                for k, pair in metric_shapes.items()
            },
        )

    def _accumulate(
        self, params: Any, acc: Any, micro: TrainBatch, denominator: jax.Array, counts: RouterCounts | None = None
    ) -> Any:
        """``acc`` plus one micro-batch's loss, gradient and metrics (its share of the mini-batch loss; with
        ``counts``, its share of the step's load-balancing term)."""
        if not self.loss_config.kl_coef:
            micro = micro._replace(ref_logprobs=None)
        loss_sum, grads_sum, metrics_sum = acc

        def loss_of_trained(trained: Any, params: Any, *rest: Any) -> Any:
            return self._loss_and_metrics(lora.with_trained_part(params, trained), *rest)

        # Differentiated in the trained part alone (with LoRA the adapters: no base-sized gradient is formed).
        grad_fn = jax.value_and_grad(loss_of_trained, has_aux=True)
        if slice_count(self.mesh) > 1:  # each slice keeps its own partial gradient: nothing crosses DCN here
            grad_fn = per_slice(grad_fn, self.mesh, split=(2,))
        (loss, metrics), grads = grad_fn(lora.trained_part(params), params, micro, denominator, counts)
        return loss_sum + loss, jax.tree.map(jnp.add, grads_sum, grads), combine_metrics(metrics_sum, metrics)

    def _apply(self, state: TrainState, acc: Any) -> tuple[TrainState, dict[str, Any]]:
        """The optimizer step on the accumulated gradient (skipped when non-finite); on several slices it first
        sums the slices' partial accumulators: the one reduction over DCN of an optimizer step."""
        if slice_count(self.mesh) > 1:
            acc = _sum_slices(acc)
        loss, grads, metrics = acc
        metrics = _pooled_router_aux_loss(metrics)
        update = guarded_update(self.optimizer, grads, state.opt_state, lora.trained_part(state.params), loss)
        new_state = TrainState(
            params=lora.with_trained_part(state.params, update.params),
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

    def _compile_update(self, state: TrainState) -> dict[str, Any]:
        """The three fixed-shape programs of ``update`` (see the module docstring); accumulators are donated."""
        jit = lambda fn, **kw: jax.jit(self._under_mesh(fn), **kw)
        if self.mesh is None:
            return {
                "zero": jit(self._zero_acc),
                "accumulate": jit(self._accumulate, donate_argnums=1),
                "apply": jit(self._apply, donate_argnums=0),
            }
        replicated = self._replicated()
        options = self.update_config.compiler_options(self.mesh.devices.flat[0].platform)
        state_shardings = jax.tree.map(lambda x: x.sharding, state)
        # Grads shard like their params (the trained part's: with LoRA the adapters).
        acc_shardings = (replicated, lora.trained_part(state_shardings.params), replicated)
        if slice_count(self.mesh) > 1:  # per-slice partial sums: a leading slice axis on every accumulator
            acc_shardings = jax.tree.map(stacked_sharding, acc_shardings)
        return {
            "zero": jit(self._zero_acc, out_shardings=acc_shardings),
            "accumulate": jit(
                self._accumulate, out_shardings=acc_shardings, donate_argnums=1, compiler_options=options
            ),
            "apply": jit(self._apply, out_shardings=(state_shardings, replicated), donate_argnums=0),
        }

    def sequence_step_batch(
        self, state: TrainState, batch: TrainBatch, path_tokens: PathTokens
    ) -> tuple[TrainBatch, dict[str, Any]]:
        """Host ``batch`` with sequence-level GSPO's per-token terms at ``state.params`` (a forward pass over
        the whole batch: a path's ratio needs all its tokens, wherever they sit), and the per-path ratio and
        clip metrics as (sum, weight) pairs."""
        logprobs = self.logprobs(state.params, batch)
        seq_loss, seq_grad, pairs = sequence_terms(path_tokens, logprobs, batch.old_logprobs, self.loss_config)
        return batch._replace(seq_loss=seq_loss, seq_grad=seq_grad), pairs

    def update(
        self,
        state: TrainState,
        batch: TrainBatch,
        path_tokens: PathTokens | None = None,
        skipped_denominator: float = 0.0,
        *,
        already_prepared: bool = False,
    ) -> tuple[TrainState, dict[str, float]]:
        """PPO on one rollout batch: ``prepare``, then ``ppo_epochs`` passes, each over ``mini_batches``
        reshuffled mini-batches of rows, one optimizer step each, its gradient accumulated over micro-batches
        of exactly ``micro_rows`` rows (rows without tokens are dropped; the batch may have any row count).
        ``path_tokens`` (``BatchInfo.path_tokens``) is needed by ``policy_loss="gspo"`` only: before each of
        its steps every path's sequence ratio is computed at the step's params (``sequence_step_batch``).
        ``skipped_denominator`` (``BatchInfo.skipped_denominator``) is the denominator of the trees the batch
        left out for zero advantage: added to the rows' own, the update trains the objective of every tree.
        ``already_prepared``: ``batch`` is ``prepare``'s output (e.g. with ``behaviour_params`` of lagged
        rollouts), used as it is.

        Metrics: the loss metrics pooled over every step (``ratio`` is the mean ratio, ``ratio_max`` the
        largest, ``clip_fraction`` the clipped share; each measured at the start of its step), the same per
        epoch as ``epoch{e}/ratio``, ``epoch{e}/ratio_max``, ``epoch{e}/clip_fraction`` (e from 1), loss (the
        sum over an epoch's steps, i.e. the full-batch objective, averaged over epochs), grad_norm averaged over
        steps, update_applied the share of applied steps, skipped_steps, masked_nonfinite_tokens (trained tokens
        left out for a −inf or NaN behaviour log-prob: ``trace_jax.rl.losses.mask_nonfinite_behaviour``), steps,
        micro_batches (forward/backward calls) and programs (distinct compiled (program, shape) pairs so far).
        """
        config = self.update_config
        sequence_level = self.loss_config.policy_loss == "gspo"
        if sequence_level and path_tokens is None:
            raise ValueError("policy_loss 'gspo' needs update(state, batch, path_tokens=info.path_tokens)")
        prepared = jax.tree.map(multihost.to_host, batch) if already_prepared else self.prepare(state, batch)
        real = np.flatnonzero(np.asarray(prepared.lengths) > 0)  # padding rows carry nothing: not run
        if not real.size:
            raise ValueError("the batch has no rows with tokens")
        # Micro-batch calls per epoch: enough for every real row, at least one per mini-batch (a batch with
        # fewer rows than mini_batches takes one step per row).
        mini_batches = min(config.mini_batches, real.size)
        calls = max(-(-real.size // self.micro_rows), mini_batches)
        if self._update_fns is None:
            self._update_fns = self._compile_update(state)
        fns = self._update_fns
        # Every mini-batch divides by the whole batch's denominator: a shared-prefix token carries paths whose
        # leaves sit in other mini-batches, so only the whole batch's count makes the mini-batch losses (and
        # gradients, at equal params) sum to the full-batch objective.
        whole = loss_denominator(np.asarray(prepared.weights), np.asarray(prepared.paths), self.loss_config)
        whole = whole + skipped_denominator
        denominator = np.float32(max(float(whole), 1e-8))
        rng = np.random.default_rng([config.shuffle_seed, int(jax.device_get(state.step))])
        outs: list[list[Any]] = []  # per epoch, each step's device metrics: fetched once, after the last step
        for _ in range(config.ppo_epochs):
            order = real[rng.permutation(real.size)] if config.mini_batches > 1 else real
            parts = np.array_split(order, calls)
            outs.append([])
            for group in np.array_split(np.arange(calls), mini_batches):
                step_batch, host_pairs = prepared, {}
                if sequence_level:
                    step_batch, host_pairs = self.sequence_step_batch(state, prepared, path_tokens)
                micros = [self._micro(step_batch, parts[i]) for i in group]
                # The load-balancing term weighs 1 / steps an epoch: an epoch's steps add coef x their mean.
                counts = self.router_counts(state.params, micros, self.loss_config.router_aux_loss_coef / mini_batches)
                acc = fns["zero"](state.params, micros[0])
                for micro in micros:
                    self.programs.add(("accumulate", micro.tokens.shape))
                    acc = fns["accumulate"](state.params, acc, micro, denominator, counts)
                state, out = fns["apply"](state, acc)
                out["pairs"] = {**out["pairs"], **host_pairs}
                outs[-1].append(out)
        pooled: dict[str, Any] | None = None
        scalars: dict[str, list[float]] = {"loss": [], "grad_norm": [], "update_applied": []}
        metrics: dict[str, float] = {}
        for epoch, steps in enumerate(jax.device_get(outs), start=1):
            epoch_pairs: dict[str, Any] | None = None
            for out in steps:
                pairs = out.pop("pairs")
                epoch_pairs = pairs if epoch_pairs is None else combine_metrics(epoch_pairs, pairs)
                for k in scalars:
                    scalars[k].append(float(out[k]))
                metrics["skipped_steps"] = float(out["skipped_steps"])
            pooled = epoch_pairs if pooled is None else combine_metrics(pooled, epoch_pairs)
            epoch_metrics = finalize_metrics(epoch_pairs)
            for k in ("ratio", "ratio_max", "clip_fraction", "behaviour_gap"):
                metrics[f"epoch{epoch}/{k}"] = epoch_metrics[k]
        metrics.update(finalize_metrics(pooled))
        steps = len(scalars["loss"])
        metrics.update({k: float(np.mean(v)) for k, v in scalars.items()})
        metrics["loss"] = float(np.sum(scalars["loss"])) / config.ppo_epochs  # an epoch's steps sum to the objective
        metrics["steps"] = float(steps)
        metrics["masked_nonfinite_tokens"] = _nonfinite_behaviour_tokens(prepared)
        metrics["micro_batches"] = float(calls * config.ppo_epochs)
        metrics["programs"] = float(len(self.programs))
        return state, metrics

    def lower_update(self, state: TrainState, micro: TrainBatch) -> dict[str, Any]:
        """``update``'s own device programs (zero, accumulate, apply), lowered for ``state`` and one micro-batch
        of ``micro_rows`` rows given as arrays or sharded ``jax.ShapeDtypeStruct`` (abstract devices of another
        platform included): ``{name: jax.stages.Lowered}``, to ``.compile()`` for the mesh's devices. The same
        jitted functions ``update`` runs; ``trace_jax.plan.compile.update_programs`` compiles them for a slice."""
        fns = self._compile_update(state)
        replicated = self._replicated()
        denominator = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
        acc = jax.eval_shape(fns["zero"], state.params, micro)
        return {
            "zero": fns["zero"].lower(state.params, micro),
            "accumulate": fns["accumulate"].lower(state.params, acc, micro, denominator),
            "apply": fns["apply"].lower(state, acc),
        }
