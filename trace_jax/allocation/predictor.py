"""The shared success predictor ``Ṽψ(H)`` of TRACE: P(success | prefix) for roots and prefixes of every prompt.

It drives allocation only (it never enters the policy loss) and is trained online on the backup targets
``V̂`` of the trees sampled so far, weighted by the leaves under each anchor (``docs/method.md``).

Variants, by config string (:data:`PREDICTORS`):

* ``mlp`` (default): a small nnx MLP over the stop-gradient policy feature at the anchor (``node.feature``,
  the final hidden state at the prefix's last token) plus a one-hot depth; weighted BCE, optax Adam, a
  replay buffer of recent anchors, running feature standardisation. ``dispersion=True`` adds a second head,
  the spread of the success probability, trained on the Beta-binomial likelihood instead of the BCE.
* ``transformer``: a small separate decoder (the policy's ``Qwen`` architecture, e.g. ``qwen3-tiny``) over
  the anchor's history ids with a value head on the last token; same training as the MLP.
* ``depth``: the weighted mean ``V̂`` per depth (the baseline the MLP must beat).
* ``beta``: a per-prompt Beta posterior over root outcomes (roots only; deeper anchors get their root's).

Every variant exposes ``predict(anchors) -> float64 [N]``, ``update(anchors) -> metrics`` and
``state_dict()`` / ``load_state_dict()`` (plain dicts of numpy arrays and numbers, for checkpoints).
What they read is gathered by :mod:`trace_jax.allocation.anchors`; their calibration is scored by
:mod:`trace_jax.allocation.calibration`; the learned ones replay anchors through
:class:`trace_jax.allocation.replay.ReplayBuffer`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.scipy.special import betaln

from trace_jax.allocation.anchors import AnchorBatch
from trace_jax.allocation.history import HISTORY_FEATURES
from trace_jax.allocation.replay import ReplayBuffer
from trace_jax.buckets import power_of_two
from trace_jax.models import ModelConfig, create_model
from trace_jax.registry import Registry

EPS = 1e-4  # predictions are clipped to [EPS, 1 - EPS]: the solvers never see a certain outcome
# The dispersion head's range: concentration (1 - rho) / rho from ~0.02 (all-pass or all-fail) to ~1000 (a sure p),
# which keeps the Beta-binomial's float32 digammas finite at EPS-sized means.
DISPERSION_RANGE = (1e-3, 0.98)


# --------------------------------------------------------------------------------------------- protocol
class SuccessPredictor(Protocol):
    def predict(self, anchors: AnchorBatch) -> np.ndarray:
        """float64 [N] P(success | anchor), in [EPS, 1 - EPS]."""
        ...

    def update(self, anchors: AnchorBatch) -> dict[str, float]:
        """Learns from anchors with ``V̂`` targets and leaf-count weights; returns training metrics."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------------------------- baselines
class DepthPredictor:
    """Weighted mean ``V̂`` per depth, blind to the prompt and the prefix: the floor a real predictor must beat."""

    def __init__(self, max_depth: int = 16, prior: float = 0.5, prior_weight: float = 1.0):
        self.max_depth = max_depth
        self.sums = np.full(max_depth + 1, prior * prior_weight)
        self.weights = np.full(max_depth + 1, prior_weight)

    def predict(self, anchors: AnchorBatch) -> np.ndarray:
        depth = np.minimum(anchors.depths_n, self.max_depth)
        return np.clip(self.sums[depth] / self.weights[depth], EPS, 1 - EPS)

    def update(self, anchors: AnchorBatch) -> dict[str, float]:
        keep = np.isfinite(anchors.targets_n) & (anchors.weights_n > 0)
        depth = np.minimum(anchors.depths_n[keep], self.max_depth)
        w = anchors.weights_n[keep]
        self.sums += np.bincount(depth, w * anchors.targets_n[keep], self.max_depth + 1)
        self.weights += np.bincount(depth, w, self.max_depth + 1)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"sums": self.sums.copy(), "weights": self.weights.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sums, self.weights = np.asarray(state["sums"], float), np.asarray(state["weights"], float)


class BetaPredictor:
    """Per-prompt Beta(a, b) posterior over root outcomes; every anchor of a prompt gets its root's mean.

    Updated from the roots' ``V̂`` and leaf counts (successes = n V̂). It is the prompt-level baseline
    (curriculum / Knapsack-RL style): it can rank prompts it has seen, but knows nothing about prefixes.
    """

    def __init__(self, prior_a: float = 1.0, prior_b: float = 1.0):
        self.prior = (prior_a, prior_b)
        self.posterior: dict[int, tuple[float, float]] = {}

    def predict(self, anchors: AnchorBatch) -> np.ndarray:
        ab = np.asarray([self.posterior.get(int(k), self.prior) for k in anchors.prompt_keys_n], float).reshape(-1, 2)
        return np.clip(ab[:, 0] / ab.sum(axis=1), EPS, 1 - EPS)

    def update(self, anchors: AnchorBatch) -> dict[str, float]:
        roots = (anchors.depths_n == 0) & np.isfinite(anchors.targets_n)
        for key, value, count in zip(
            anchors.prompt_keys_n[roots], anchors.targets_n[roots], anchors.weights_n[roots], strict=True
        ):
            a, b = self.posterior.get(int(key), self.prior)
            self.posterior[int(key)] = (a + count * value, b + count * (1.0 - value))
        return {}

    def state_dict(self) -> dict[str, Any]:
        keys = np.asarray(sorted(self.posterior), np.int64)
        ab = np.asarray([self.posterior[int(k)] for k in keys], float).reshape(-1, 2)
        return {"keys": keys, "ab": ab}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.posterior = {int(k): (float(a), float(b)) for k, (a, b) in zip(state["keys"], state["ab"], strict=True)}


# ----------------------------------------------------------------------------------------------- the MLP
class _MLP(nnx.Module):
    """Logits [N] (one head: P(success)), or [N, 2] with ``dispersion`` (P(success) and the dispersion rho)."""

    def __init__(self, in_dim: int, hidden: int, num_layers: int, rngs: nnx.Rngs, dispersion: bool = False):
        dims = [in_dim] + [hidden] * num_layers
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(dims)])
        self.head = nnx.Linear(dims[-1], 2 if dispersion else 1, rngs=rngs)
        self.dispersion = dispersion

    def __call__(self, x_nf: jax.Array) -> jax.Array:
        for layer in self.layers:
            x_nf = nnx.gelu(layer(x_nf))
        logits = self.head(x_nf)
        return logits if self.dispersion else logits[:, 0]


def _bce_loss(graphdef, params, inputs, y_n, w_n):
    logits = nnx.merge(graphdef, params)(*inputs)
    per_anchor = optax.sigmoid_binary_cross_entropy(logits, y_n)
    return (w_n * per_anchor).sum() / jnp.maximum(w_n.sum(), 1e-9)


def _beta_binomial_loss(graphdef, params, inputs, y_n, w_n):
    """Per-leaf NLL of each anchor's ``y * w`` successes in ``w`` leaves under a Beta-binomial with mean
    ``sigmoid(logit 0)`` and dispersion ``rho = sigmoid(logit 1)`` (concentration ``(1 - rho) / rho``).
    With one leaf it is the BCE; from two leaves on, how much the outcomes under one anchor agree sets rho."""
    logits = nnx.merge(graphdef, params)(*inputs)
    mean = jnp.clip(jax.nn.sigmoid(logits[:, 0]), EPS, 1 - EPS)
    rho = jnp.clip(jax.nn.sigmoid(logits[:, 1]), *DISPERSION_RANGE)
    concentration = (1.0 - rho) / rho
    a, b = mean * concentration, (1.0 - mean) * concentration
    successes = y_n * w_n
    log_lik = betaln(successes + a, w_n - successes + b) - betaln(a, b)
    return -log_lik.sum() / jnp.maximum(w_n.sum(), 1e-9)


def _make_train_step(loss_fn: Callable[..., jax.Array]):
    @functools.partial(jax.jit, static_argnames=("graphdef", "optimizer"))
    def train_step(graphdef, optimizer, params, opt_state, inputs, y_n, w_n):
        loss, grads = jax.value_and_grad(loss_fn, argnums=1)(graphdef, params, inputs, y_n, w_n)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


# One Adam step on the leaf-weighted BCE of ``model(*inputs)`` logits against soft targets ``y_n``.
_train_step = _make_train_step(_bce_loss)
# The same on the Beta-binomial NLL (a two-headed MLP: mean and dispersion).
_dispersion_train_step = _make_train_step(_beta_binomial_loss)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _predict(graphdef, params, inputs):
    return jax.nn.sigmoid(nnx.merge(graphdef, params)(*inputs))


@functools.cache
def adam(learning_rate: float) -> optax.GradientTransformation:
    """One Adam transformation per learning rate: it is a static argument of ``_train_step``, so predictors
    built later (a new scheduler, a resumed run, a benchmark's second pass) reuse the compiled step."""
    return optax.adam(learning_rate)


def _bucket(n: int) -> int:
    """Pads prediction batches to powers of two (at least 64) so a run compiles a handful of programs."""
    return power_of_two(n, minimum=64)


class MLPPredictor:
    """Small MLP over [standardised anchor feature, has-feature bit, one-hot depth] -> P(success).

    Args:
      hidden / num_layers: MLP width and depth.
      max_depth: depths above it share the last one-hot slot.
      learning_rate: Adam step size.
      train_steps / batch_size: minibatch steps per ``update`` call, drawn from the replay buffer.
      replay_size: most recent training anchors kept for replay (checkpointed, so a resume is exact).
      feature_dim: anchor feature size; None builds the network at the first batch.
      seed: initialisation and minibatch sampling.
      dispersion: *(ours)* a second head predicts how spread the anchor's success probability is, trained on
        the Beta-binomial likelihood of the outcomes under each anchor (:meth:`predict_dispersion`). A prompt
        the features cannot tell between all-pass and all-fail gets a high dispersion, so the solvers'
        expected ``V_root`` no longer promises it a mixed group (``allocation.solvers``).
      history: *(ours)* also read the prompt's outcome history on earlier visits (``AnchorBatch.history_nh``,
        :class:`trace_jax.allocation.history.PromptHistory`: a Beta posterior over its past rollouts, their count,
        the age of the last visit, whether it was all-equal). A prompt never seen has zero history features (and
        a 0 seen bit), so its prediction is the network's from the hidden state alone.
    """

    def __init__(
        self,
        hidden: int = 64,
        num_layers: int = 2,
        max_depth: int = 8,
        learning_rate: float = 3e-3,
        train_steps: int = 32,
        batch_size: int = 256,
        replay_size: int = 8192,
        feature_dim: int | None = None,
        seed: int = 0,
        dispersion: bool = False,
        history: bool = False,
    ):
        self.hidden, self.num_layers, self.max_depth = hidden, num_layers, max_depth
        self.dispersion, self.history = dispersion, history
        self.train_steps, self.batch_size = train_steps, batch_size
        self.seed = seed
        self.optimizer = adam(float(learning_rate))
        self.feature_dim: int | None = None
        self.replay = ReplayBuffer(replay_size)
        if feature_dim is not None:
            self._build(feature_dim)

    # ---------------------------------------------------------------------------------------- set-up
    def _build(self, feature_dim: int) -> None:
        self.feature_dim = feature_dim
        in_dim = feature_dim + 1 + self.max_depth + 1 + (HISTORY_FEATURES if self.history else 0)
        model = _MLP(in_dim, self.hidden, self.num_layers, nnx.Rngs(self.seed), self.dispersion)
        self.graphdef, self.params = nnx.split(model, nnx.Param)
        self.opt_state = self.optimizer.init(self.params)
        self.count = 0.0  # running feature statistics (Chan et al. parallel update)
        self.mean = np.zeros(feature_dim)
        self.m2 = np.zeros(feature_dim)
        self.updates = 0

    def _ensure_built(self, anchors: AnchorBatch) -> bool:
        """Builds the network at the first batch with features; False while no feature size is known."""
        if not anchors.has_feature_n.any():
            return self.feature_dim is not None
        dim = anchors.features_nd.shape[1]
        if self.feature_dim is None:
            self._build(dim)
        elif dim != self.feature_dim:
            raise ValueError(f"anchor features have size {dim}, the predictor was built for {self.feature_dim}")
        return True

    def _features(self, anchors: AnchorBatch) -> np.ndarray:
        """Anchor features as [N, feature_dim] (zeros for a batch without any feature)."""
        if anchors.features_nd.shape[1] != self.feature_dim:
            return np.zeros((len(anchors), self.feature_dim), np.float32)
        return anchors.features_nd

    def _history(self, anchors: AnchorBatch) -> np.ndarray:
        """float32 [N, HISTORY_FEATURES] history features (zeros when the anchors carry none); [N, 0] without."""
        if not self.history:
            return np.zeros((len(anchors), 0), np.float32)
        if anchors.history_nh is None:
            return np.zeros((len(anchors), HISTORY_FEATURES), np.float32)
        return anchors.history_nh

    def _inputs(
        self, features_nd: np.ndarray, has_feature_n: np.ndarray, depths_n: np.ndarray, history_nh: np.ndarray
    ) -> np.ndarray:
        std = np.sqrt(self.m2 / max(self.count - 1.0, 1.0)) + 1e-6
        x = np.where(has_feature_n[:, None], (features_nd - self.mean) / std, 0.0)
        depth = np.eye(self.max_depth + 1)[np.minimum(depths_n, self.max_depth)]
        return np.concatenate([x, has_feature_n[:, None], depth, history_nh], axis=1).astype(np.float32)

    # ------------------------------------------------------------------------------------------- use
    def _heads(self, anchors: AnchorBatch) -> np.ndarray | None:
        """float64 [N] P(success), or [N, 2] with the dispersion; None before the network is built."""
        n = len(anchors)
        if not self._ensure_built(anchors):
            return None
        x = self._inputs(self._features(anchors), anchors.has_feature_n, anchors.depths_n, self._history(anchors))
        padded = np.zeros((_bucket(n), x.shape[1]), np.float32)
        padded[:n] = x
        probs = np.asarray(_predict(self.graphdef, self.params, (padded,)))[:n]
        return np.clip(probs.astype(np.float64), EPS, 1 - EPS)

    def predict(self, anchors: AnchorBatch) -> np.ndarray:
        heads = self._heads(anchors)
        if heads is None:
            return np.full(len(anchors), 0.5)  # nothing seen yet: every outcome equally likely
        return heads[:, 0] if self.dispersion else heads

    def predict_dispersion(self, anchors: AnchorBatch) -> np.ndarray | None:
        """float64 [N] predicted dispersion rho of each anchor's success probability (``Var(p) = rho v (1 - v)``);
        None for a predictor without the dispersion head. Before it has seen any feature: 0.5."""
        if not self.dispersion:
            return None
        heads = self._heads(anchors)
        return np.full(len(anchors), 0.5) if heads is None else np.clip(heads[:, 1], *DISPERSION_RANGE)

    def update(self, anchors: AnchorBatch) -> dict[str, float]:
        keep = np.isfinite(anchors.targets_n) & (anchors.weights_n > 0)
        if not self._ensure_built(anchors) or not keep.any():
            return {}
        new = {
            "features": self._features(anchors)[keep],
            "has_feature": anchors.has_feature_n[keep],
            "depths": anchors.depths_n[keep],
            "targets": anchors.targets_n[keep],
            "weights": anchors.weights_n[keep],
            **({"history": self._history(anchors)[keep]} if self.history else {}),
        }
        self._update_statistics(new["features"][new["has_feature"]])
        self.replay.add(new)
        rng = np.random.default_rng([self.seed, self.updates])  # reproducible after a checkpoint restore
        losses = []
        no_history = np.zeros((self.batch_size, 0), np.float32)
        for _ in range(self.train_steps):
            batch = self.replay.sample(rng, self.batch_size)
            # inputs per minibatch: with policy-sized features (thousands of dims) the whole replay would not fit
            x = self._inputs(batch["features"], batch["has_feature"], batch["depths"], batch.get("history", no_history))
            train_step = _dispersion_train_step if self.dispersion else _train_step
            self.params, self.opt_state, loss = train_step(
                self.graphdef,
                self.optimizer,
                self.params,
                self.opt_state,
                (x,),
                batch["targets"].astype(np.float32),
                batch["weights"].astype(np.float32),
            )
            losses.append(loss)
        self.updates += 1
        return {"predictor/loss": float(np.mean(jax.device_get(losses)))}

    def _update_statistics(self, features_nd: np.ndarray) -> None:
        n = features_nd.shape[0]
        if n == 0:
            return
        batch_mean = features_nd.mean(axis=0)
        batch_m2 = ((features_nd - batch_mean) ** 2).sum(axis=0)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean = self.mean + delta * n / total
        self.m2 = self.m2 + batch_m2 + delta**2 * self.count * n / total
        self.count = total

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Params (nested dict), optimizer state (list of leaves), feature statistics, replay, counters; numpy."""
        if self.feature_dim is None:
            return {"feature_dim": -1}
        return {
            "feature_dim": self.feature_dim,
            "params": jax.tree.map(np.asarray, nnx.to_pure_dict(self.params)),
            "opt_state": [np.asarray(leaf) for leaf in jax.tree.leaves(self.opt_state)],
            "count": self.count,
            "mean": self.mean.copy(),
            "m2": self.m2.copy(),
            "updates": self.updates,
            "replay": self.replay.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["feature_dim"]) < 0:
            return
        self._build(int(state["feature_dim"]))
        nnx.replace_by_pure_dict(self.params, jax.tree.map(jnp.asarray, state["params"]))
        treedef = jax.tree.structure(self.opt_state)
        self.opt_state = jax.tree.unflatten(treedef, [jnp.asarray(leaf) for leaf in state["opt_state"]])
        self.count, self.updates = float(state["count"]), int(state["updates"])
        self.mean, self.m2 = np.asarray(state["mean"], float), np.asarray(state["m2"], float)
        self.replay.load_state_dict(state.get("replay", {}))


# ------------------------------------------------------------------------------- the prefix transformer
class _PrefixValueModel(nnx.Module):
    """The policy's decoder architecture (``trace_jax.models.qwen.Qwen``) with a value head on the last token."""

    def __init__(self, config: Any, rngs: nnx.Rngs):
        self.backbone = create_model(config, rngs)
        self.head = nnx.Linear(config.hidden_size, 1, rngs=rngs)

    def __call__(self, tokens_bt: jax.Array, last_b: jax.Array) -> jax.Array:
        hidden_btd, _ = self.backbone.hidden(tokens_bt)
        last_bd = jnp.take_along_axis(hidden_btd, last_b[:, None, None], axis=1)[:, 0]
        return self.head(last_bd.astype(jnp.float32))[:, 0]  # logits [B]


class TransformerPredictor:
    """A small separate decoder over the anchor's history ids (the last ``max_len``), value head on its last token.

    Args:
      preset / model_overrides: ``ModelConfig.preset(preset, **model_overrides)`` (e.g. ``vocab_size``).
      max_len: most recent history tokens it reads; batches pad to powers of two up to it.
      learning_rate / train_steps / batch_size / replay_size / seed: as for :class:`MLPPredictor`.
    """

    needs_prefix_ids = True

    def __init__(
        self,
        preset: str = "qwen3-tiny",
        model_overrides: dict[str, Any] | None = None,
        max_len: int = 256,
        learning_rate: float = 1e-3,
        train_steps: int = 16,
        batch_size: int = 32,
        replay_size: int = 2048,
        seed: int = 0,
    ):
        self.config = ModelConfig.preset(preset, **(model_overrides or {}))
        self.max_len, self.train_steps, self.batch_size = max_len, train_steps, batch_size
        self.seed = seed
        self.optimizer = adam(float(learning_rate))
        self.graphdef, self.params = nnx.split(_PrefixValueModel(self.config, nnx.Rngs(seed)), nnx.Param)
        self.opt_state = self.optimizer.init(self.params)
        self.updates = 0
        self.replay = ReplayBuffer(replay_size)

    def _tokens(self, prefix_ids: Sequence[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """int32 [N, L] right-padded last-``max_len`` ids and int32 [N] index of each last real token."""
        if prefix_ids is None:
            raise ValueError("TransformerPredictor needs anchors gathered with_prefix_ids=True")
        rows = [np.asarray(ids, np.int32)[-self.max_len :] for ids in prefix_ids]
        top = max((int(r.max()) for r in rows if r.size), default=0)
        if top >= self.config.vocab_size:
            raise ValueError(
                f"prefix token id {top} >= vocab_size {self.config.vocab_size}; "
                "set model_overrides={'vocab_size': ...} to the tokenizer's size"
            )
        length = min(self.max_len, max(16, 1 << (max((r.size for r in rows), default=1) - 1).bit_length()))
        tokens = np.zeros((len(rows), length), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : r.size] = r
        return tokens, np.asarray([max(r.size - 1, 0) for r in rows], np.int32)

    def predict(self, anchors: AnchorBatch) -> np.ndarray:
        n = len(anchors)
        tokens, last = self._tokens(anchors.prefix_ids)
        padded = np.zeros((_bucket(n), tokens.shape[1]), np.int32)
        padded[:n] = tokens
        last_padded = np.zeros(padded.shape[0], np.int32)
        last_padded[:n] = last
        probs = np.asarray(_predict(self.graphdef, self.params, (padded, last_padded)))[:n]
        return np.clip(probs.astype(np.float64), EPS, 1 - EPS)

    def update(self, anchors: AnchorBatch) -> dict[str, float]:
        keep = np.flatnonzero(np.isfinite(anchors.targets_n) & (anchors.weights_n > 0))
        if keep.size == 0:
            return {}
        tokens, last = self._tokens([anchors.prefix_ids[i] for i in keep])
        full = np.zeros((keep.size, self.max_len), np.int32)
        full[:, : tokens.shape[1]] = tokens
        new = {"tokens": full, "last": last, "targets": anchors.targets_n[keep], "weights": anchors.weights_n[keep]}
        self.replay.add(new)
        rng = np.random.default_rng([self.seed, self.updates])
        losses = []
        for _ in range(self.train_steps):
            batch = self.replay.sample(rng, self.batch_size)
            width = min(self.max_len, max(16, 1 << int(batch["last"].max()).bit_length()))
            inputs = (batch["tokens"][:, :width], batch["last"])
            self.params, self.opt_state, loss = _train_step(
                self.graphdef,
                self.optimizer,
                self.params,
                self.opt_state,
                inputs,
                batch["targets"].astype(np.float32),
                batch["weights"].astype(np.float32),
            )
            losses.append(loss)
        self.updates += 1
        return {"predictor/loss": float(np.mean(jax.device_get(losses)))}

    def state_dict(self) -> dict[str, Any]:
        return {
            "params": jax.tree.map(np.asarray, nnx.to_pure_dict(self.params)),
            "opt_state": [np.asarray(leaf) for leaf in jax.tree.leaves(self.opt_state)],
            "updates": self.updates,
            "replay": self.replay.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        nnx.replace_by_pure_dict(self.params, jax.tree.map(jnp.asarray, state["params"]))
        treedef = jax.tree.structure(self.opt_state)
        self.opt_state = jax.tree.unflatten(treedef, [jnp.asarray(leaf) for leaf in state["opt_state"]])
        self.updates = int(state["updates"])
        self.replay.load_state_dict(state.get("replay", {}))


PREDICTORS: Registry[Callable[..., SuccessPredictor]] = Registry(
    "predictor",
    {"mlp": MLPPredictor, "transformer": TransformerPredictor, "depth": DepthPredictor, "beta": BetaPredictor},
)


def make_predictor(name: str, **kwargs: Any) -> SuccessPredictor:
    """Builds the predictor registered as ``name`` with constructor ``kwargs``."""
    return PREDICTORS[name](**kwargs)
