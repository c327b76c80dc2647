"""A ground-truth rollout simulator: allocation ablations in seconds, without a language model.

Model *(ours)*. Each prompt ``i`` of a fixed pool has a latent root success probability ``p_0`` drawn from a
U-shaped Beta (most questions are either solved almost always or almost never, a few are in between), a
noise concentration ``kappa_i`` (how much a single turn can swing the outcome) and a turn-length scale.
Every turn moves the success probability as a bounded martingale::

    p_{t+1} ~ Beta(kappa_{i,t} p_t, kappa_{i,t} (1 - p_t)),   kappa_{i,t} = kappa_i * (1 + depth_growth * t)

so ``E[p_{t+1} | p_t] = p_t``: the true value of a prefix is exactly its current ``p_t``, and later turns move
it less than early ones (the decisive search usually happens first). A trajectory stops after each turn with
probability ``stop_probability`` (always at ``max_turns``); the leaf reward is ``Bernoulli(p_T)``.

What a policy may see is what a real runner gives it: per node the sampled turn ids (dummy ids of the right
length), observation ids, per-token entropies, and a ``feature`` vector -- a noisy linear image of
``logit(p_t)`` plus depth, a per-prompt nuisance vector and per-node noise, standing in for the policy's
hidden state at the anchor. The true ``p_t`` lives in ``node.info[TRUE_P_KEY]`` and is read only by
``true_success_probability`` (the oracle policy); allocation policies never look at it.

Calibration of the defaults (not tuned for any policy): the difficulty Beta makes uniform GRPO with 4 rollouts
per prompt mix ~26% of prompts, the paper's GRPO baseline (26.8%); ``feature_signal`` gives the MLP predictor a
held-out AUC of ~0.93 on uniform-policy anchors (~0.8 on the harder anchors TRACE picks), in the range of
hidden-state probes of LLM success. ``trace_jax.bench.allocation`` shows how results move with these knobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from trace_jax.rollout.backend import ContinuationRequest, RolloutStats
from trace_jax.rollout.tree import RolloutTree

TRUE_P_KEY = "_simulator_success_probability"
BLUR_KEY = "_blurred_oracle_noise"


@dataclasses.dataclass(frozen=True)
class SimulatorConfig:
    """Knobs of the simulated world; the defaults are the benchmark's "default simulator setting"."""

    num_prompts: int = 4096  # size of the prompt pool batches are drawn from
    difficulty_a: float = 0.2  # root p_0 ~ Beta(a, b): U-shaped; uniform G=4 then mixes ~27% of prompts (paper)
    difficulty_b: float = 0.25
    kappa_median: float = 4.0  # per-prompt turn-noise concentration, log-normal around this median
    kappa_log_std: float = 0.6
    depth_growth: float = 0.35  # later turns move p less: kappa grows linearly with depth
    max_turns: int = 6
    stop_probability: float = 0.3  # chance a trajectory answers after each turn (from turn 1)
    turn_tokens_mean: float = 160.0  # mean sampled tokens per turn (prompt scale multiplies it)
    answer_tokens_mean: float = 60.0  # the final (answer) turn is shorter
    max_turn_tokens: int = 512
    observation_tokens: int = 96  # tool tokens after every non-final turn (not generated, not charged)
    prompt_tokens: int = 64
    feature_dim: int = 32
    feature_signal: float = 0.5  # logit(p_t) scale along the signal direction: held-out MLP AUC ~0.8-0.93
    feature_noise: float = 1.0  # std of per-node feature noise
    prompt_nuisance: float = 1.0  # std of the per-prompt offset shared by all nodes of a prompt
    vocab_size: int = 512


def _logit(p: np.ndarray | float) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p) - np.log1p(-p)


class Simulator:
    """A prompt pool plus a :class:`~trace_jax.rollout.backend.RolloutBackend` over it.

    Args:
      config: the world (see :class:`SimulatorConfig`).
      seed: seeds the pool and the sampling stream; the same seed gives the same pool and trajectories.
    """

    def __init__(self, config: SimulatorConfig | None = None, seed: int = 0):
        self.config = cfg = config or SimulatorConfig()
        if not 0 < cfg.stop_probability <= 1 or cfg.max_turns < 1:
            raise ValueError("SimulatorConfig needs 0 < stop_probability <= 1 and max_turns >= 1")
        pool_rng = np.random.default_rng([seed, 0])
        self.rng = np.random.default_rng([seed, 1])
        n = cfg.num_prompts
        self.root_p = pool_rng.beta(cfg.difficulty_a, cfg.difficulty_b, n)
        self.kappa = cfg.kappa_median * np.exp(cfg.kappa_log_std * pool_rng.standard_normal(n))
        self.length_scale = np.exp(0.3 * pool_rng.standard_normal(n))
        self.nuisance = cfg.prompt_nuisance * pool_rng.standard_normal((n, cfg.feature_dim))
        directions = np.linalg.qr(pool_rng.standard_normal((cfg.feature_dim, 2)))[0]
        self.signal_direction, self.depth_direction = directions[:, 0], directions[:, 1]

    # ------------------------------------------------------------------------------------------- prompts
    def sample_batch(self, batch_size: int) -> list[RolloutTree]:
        """Fresh one-node trees (root only, with its feature) for ``batch_size`` prompts drawn from the pool."""
        if not 0 <= batch_size <= self.config.num_prompts:
            raise ValueError(f"batch_size={batch_size} must be within the pool (SimulatorConfig.num_prompts)")
        indices = self.rng.choice(self.config.num_prompts, size=batch_size, replace=False)
        return [self.new_tree(int(i)) for i in indices]

    def new_tree(self, prompt_index: int) -> RolloutTree:
        cfg = self.config
        ids = self.rng.integers(1, cfg.vocab_size, cfg.prompt_tokens)
        tree = RolloutTree(ids, task={"prompt": prompt_index}, prompt_index=prompt_index)
        p = float(self.root_p[prompt_index])
        tree.root.feature = self._feature(prompt_index, p, 0)
        tree.root.info[TRUE_P_KEY] = p
        return tree

    @property
    def max_tokens_per_rollout(self) -> int:
        """The most one continuation can generate here: every turn at its token limit."""
        return self.config.max_turns * self.config.max_turn_tokens

    def true_success_probability(self, tree: RolloutTree, node_id: int) -> float:
        """The exact P(success | prefix): only a simulator knows it (used by the oracle policy)."""
        return float(tree[node_id].info[TRUE_P_KEY])

    # ------------------------------------------------------------------------------------------ backend
    def continue_anchors(self, requests: Sequence[ContinuationRequest]) -> RolloutStats:
        """Samples each request ``k`` times to a leaf (or ``max_turns`` turns), appending nodes to its tree; returns
        the cost."""
        stats = RolloutStats()
        for request in requests:
            if request.tree[request.node_id].is_leaf:
                raise ValueError(f"node {request.node_id} is a leaf; only anchors can be continued")
            for _ in range(request.k):
                stats += self._rollout(request.tree, request.node_id, request.max_turns)
        return stats

    def _rollout(self, tree: RolloutTree, node_id: int, max_turns: int | None = None) -> RolloutStats:
        cfg, rng = self.config, self.rng
        i = tree.prompt_index
        p = float(tree[node_id].info[TRUE_P_KEY])
        depth = tree[node_id].depth
        stats = RolloutStats(forward_tokens=tree.prefix_length(node_id))
        for _ in range(max_turns or cfg.max_turns):
            depth += 1
            kappa = self.kappa[i] * (1.0 + cfg.depth_growth * (depth - 1))
            a, b = max(kappa * p, 1e-3), max(kappa * (1 - p), 1e-3)
            p = float(np.clip(rng.beta(a, b), 0.0, 1.0))
            done = depth >= cfg.max_turns or rng.random() < cfg.stop_probability
            mean = (cfg.answer_tokens_mean if done else cfg.turn_tokens_mean) * self.length_scale[i]
            n_tokens = int(np.clip(rng.gamma(4.0, mean / 4.0), 4, cfg.max_turn_tokens))
            # The policy is unsure where the next turn can swing the outcome: entropy tracks the step noise.
            entropy = 0.2 + 1.5 / np.sqrt(kappa) * np.exp(0.3 * rng.standard_normal())
            observation = None if done else np.full(cfg.observation_tokens, 3, np.int32)
            reward = float(rng.random() < p) if done else None
            node = tree.add_turn(
                node_id,
                token_ids=np.full(n_tokens, 2, np.int32),
                logprobs=np.full(n_tokens, -entropy, np.float32),
                entropies=np.full(n_tokens, entropy, np.float32),
                observation_ids=observation,
                reward=reward,
                feature=self._feature(i, p, depth),
                info={TRUE_P_KEY: p},
            )
            stats.generated_tokens += n_tokens
            stats.forward_tokens += n_tokens + (0 if done else cfg.observation_tokens)
            if done:
                stats.rollouts = 1
                return stats
            node_id = node
        return stats  # stopped after ``max_turns``: ``node_id`` stays an anchor

    def _feature(self, prompt_index: int, p: float, depth: int) -> np.ndarray:
        cfg = self.config
        noise = cfg.feature_noise * self.rng.standard_normal(cfg.feature_dim)
        signal = cfg.feature_signal * float(_logit(p)) * self.signal_direction
        return (signal + 0.5 * depth * self.depth_direction + self.nuisance[prompt_index] + noise).astype(np.float32)


class BlurredOracle:
    """A :class:`Simulator` whose ``true_success_probability`` is seen through noise: a success estimate of chosen
    quality, for asking how good the predictor must be (``trace_jax.bench.predictor_need``).

    It reports ``sigmoid(logit(p) + noise * z)`` with ``z ~ N(0, 1)`` drawn once per node, so, like a predictor,
    it gives a node the same estimate each time it is asked; ``noise = 0`` is the oracle itself. Everything
    else is the simulator's.
    """

    def __init__(self, simulator: Simulator, noise: float, seed: int = 0):
        if not noise >= 0:
            raise ValueError(f"noise={noise} must be >= 0")
        self.simulator, self.noise = simulator, float(noise)
        self._rng = np.random.default_rng([seed, 2])

    def __getattr__(self, name: str):
        return getattr(self.simulator, name)

    def true_success_probability(self, tree: RolloutTree, node_id: int) -> float:
        p = self.simulator.true_success_probability(tree, node_id)
        if self.noise == 0:
            return p
        info = tree[node_id].info
        if BLUR_KEY not in info:
            info[BLUR_KEY] = float(self._rng.standard_normal())
        return float(1.0 / (1.0 + np.exp(-(_logit(p) + self.noise * info[BLUR_KEY]))))
