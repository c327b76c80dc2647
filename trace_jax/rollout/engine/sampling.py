"""Token sampling: greedy, temperature, top-k and top-p, with the log-probabilities RL needs.

Every sampled token comes with three numbers:

* ``logprobs``: its log-probability under the *untempered* policy, ``log_softmax(logits)[token]``
  (diagnostics; it does not depend on the sampling knobs);
* ``sample_logprobs``: its log-probability under the distribution it was actually drawn from (tempered,
  truncated by top-k / top-p, renormalised); 0 for greedy decoding, which is deterministic. These are the
  behaviour log-probs PPO's ratio needs; ``token_sample_logprobs`` recomputes them for given tokens;
* ``entropies``: the entropy of the untempered policy at that step (for entropy-guided branching).

Randomness comes only from the keys passed in, one per row, so a row's draw does not depend on the other
rows of the batch: a sequence sampled alone or inside any batch gets the same tokens from the same key.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token.

    temperature: divides the logits; ``0`` means greedy (argmax).
    top_k: keep only the ``k`` most likely tokens (``0`` = no limit). Tokens tied with the k-th are kept too.
    top_p: keep the smallest set of most likely tokens whose (tempered) probability reaches ``top_p``
      (``1.0`` = no limit). The most likely token is always kept.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k} must be >= 0 (0 = no top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p={self.top_p} must be in (0, 1] (1 = no top-p)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def make_greedy(cls) -> SamplingConfig:
        return cls(temperature=0.0)


class TokenSample(NamedTuple):
    """One sampled token per row: int32 ``tokens [B]`` and float32 ``logprobs / sample_logprobs / entropies [B]``."""

    tokens: jax.Array
    logprobs: jax.Array
    sample_logprobs: jax.Array
    entropies: jax.Array


def truncated_logits(logits_bv: jax.Array, config: SamplingConfig) -> jax.Array:
    """float32 [B, V]: tempered logits with every token outside the top-k / top-p set at -inf (not greedy)."""
    scaled_bv = logits_bv.astype(jnp.float32) / config.temperature
    if 0 < config.top_k < logits_bv.shape[-1]:
        kth_b1 = jax.lax.top_k(scaled_bv, config.top_k)[0][:, -1:]
        scaled_bv = jnp.where(scaled_bv >= kth_b1, scaled_bv, _NEG_INF)
    if config.top_p < 1.0:
        sorted_bv = jnp.sort(scaled_bv, axis=-1)[:, ::-1]
        probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
        mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
        # The kept set is a prefix of the sorted order: a token stays if the mass before it is below top_p.
        kept_bv = mass_before_bv < config.top_p
        threshold_b1 = jnp.min(jnp.where(kept_bv, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        scaled_bv = jnp.where(scaled_bv >= threshold_b1, scaled_bv, _NEG_INF)
    return scaled_bv


def _pick(table_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(table_bv, tokens_b[:, None], axis=-1)[:, 0]


def sample(logits_bv: jax.Array, keys_b: jax.Array, config: SamplingConfig) -> TokenSample:
    """Draws one token per row of ``logits_bv`` (float [B, V]) with the per-row PRNG ``keys_b`` ([B] keys).

    Pure and jit-friendly; ``config`` is static. Rows are independent: row b's token depends only on
    ``logits_bv[b]`` and ``keys_b[b]``. This runs once per decode step, so it works from log-sum-exps and
    never materialises a normalised [B, V] table: ``log p(t) = l_t - lse(l)``, ``H = lse(l) - sum_t p_t l_t``.
    """
    logits_bv = logits_bv.astype(jnp.float32)
    lse_b = jax.nn.logsumexp(logits_bv, axis=-1)
    probs_bv = jnp.exp(logits_bv - lse_b[:, None])
    entropy_b = lse_b - jnp.sum(probs_bv * logits_bv, axis=-1)
    if config.greedy:
        tokens_b = jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
        sample_logprobs_b = jnp.zeros_like(lse_b)
    else:
        draw_bv = truncated_logits(logits_bv, config)
        tokens_b = jax.vmap(jax.random.categorical)(keys_b, draw_bv).astype(jnp.int32)
        sample_logprobs_b = _pick(draw_bv, tokens_b) - jax.nn.logsumexp(draw_bv, axis=-1)
    return TokenSample(tokens_b, _pick(logits_bv, tokens_b) - lse_b, sample_logprobs_b, entropy_b)


def token_sample_logprobs(logits_nv: jax.Array, tokens_n: jax.Array, config: SamplingConfig) -> jax.Array:
    """float32 [N]: log-probability of ``tokens_n`` under the distribution ``sample`` draws from given
    ``logits_nv`` (float [N, V]): tempered and truncated like ``sample``, 0 for greedy (as ``sample`` reports).

    What the trainer uses to recompute behaviour log-probs under the sampling transform; a token outside the
    truncated support gets -inf.
    """
    if config.greedy:
        return jnp.zeros(tokens_n.shape, jnp.float32)
    draw_nv = truncated_logits(logits_nv, config)
    return _pick(draw_nv, tokens_n) - jax.nn.logsumexp(draw_nv, axis=-1)
