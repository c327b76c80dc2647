import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.config_utils import from_config
from trace_jax.rl.losses import (
    AGGREGATIONS,
    KL_PENALTIES,
    LossConfig,
    LossInputs,
    combine_metrics,
    compute_loss,
    finalize_metrics,
    loss_denominator,
)
from trace_jax.rl.sequences import PathTokens, sequence_terms


def _inputs(logprobs, old, adv, weights, segments=None, ref=None, entropies=None):
    arr = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    weights = arr(weights)
    segments = jnp.zeros(weights.shape, jnp.int32) if segments is None else jnp.asarray(segments, jnp.int32)
    return LossInputs.from_advantages(
        arr(logprobs), arr(old), arr(adv), weights, segments, ref_logprobs=arr(ref), entropies=arr(entropies)
    )


def _loss(inputs, config, paths=None, **kwargs):
    out = compute_loss(inputs, config, **kwargs)
    return out.numerator / loss_denominator(inputs.weights, paths, config), out.metrics


def test_ppo_clip_low_high_by_hand():
    ratios = np.array([[1.5, 0.5, 1.1]])
    inputs = _inputs(np.log(ratios), np.zeros((1, 3)), [[1.0, -1.0, 2.0]], np.ones((1, 3)))
    loss, metrics = _loss(inputs, LossConfig(clip_low=0.2, clip_high=0.28))
    # t0: A>0, ρ above 1.28 -> −1.28; t1: A<0, ρ below 0.8 -> +0.8; t2: inside the range -> −2.2
    assert float(loss) == pytest.approx((-1.28 + 0.8 - 2.2) / 3, rel=1e-5)
    # The clip fraction is the clipped share of the |advantage| mass: (1 + 1) / (1 + 1 + 2).
    assert finalize_metrics(metrics)["clip_fraction"] == pytest.approx(0.5)
    assert finalize_metrics(metrics)["ratio_max"] == pytest.approx(1.5, rel=1e-6)


def test_dual_clip_caps_negative_advantage_loss():
    inputs = _inputs(np.log([[5.0, 5.0]]), np.zeros((1, 2)), [[-1.0, 1.0]], np.ones((1, 2)))
    plain, _ = _loss(inputs, LossConfig())
    dual, metrics = _loss(inputs, LossConfig(dual_clip=3.0))
    # A=−1, ρ=5: PPO gives max(5, 0.8) = 5; dual clip caps at 3. A=+1: min(−5, −1.28) side untouched (−1.28).
    assert float(plain) == pytest.approx((5.0 - 1.28) / 2, rel=1e-5)
    assert float(dual) == pytest.approx((3.0 - 1.28) / 2, rel=1e-5)
    assert finalize_metrics(metrics)["dual_clip_fraction"] == pytest.approx(1.0)  # of the negative-advantage mass


def test_tool_tokens_carry_no_loss_and_no_gradient():
    # Token 2 is an observation (weight 0) with a huge advantage and wild log-probs: it must not matter.
    logprobs = jnp.log(jnp.array([[0.5, 0.4, 1e-30, 0.3]]))
    old = jnp.log(jnp.array([[0.4, 0.4, 0.9, 0.3]]))
    adv = jnp.array([[1.0, 1.0, 1e6, -1.0]])
    weights = jnp.array([[1.0, 1.0, 0.0, 1.0]])
    ref = old + 0.1
    ent = jnp.array([[0.5, 0.5, 100.0, 0.5]])
    for name in ("ppo", "gspo_turn"):  # gspo's terms come from whole paths: test_packing, test_trainer
        config = LossConfig(policy_loss=name, kl_coef=0.1, entropy_coef=0.01)

        def f(lp, config=config):
            return _loss(_inputs(lp, old, adv, weights, [[1, 1, 2, 2]], ref, ent), config)[0]

        loss, grad = jax.value_and_grad(f)(logprobs)
        assert np.isfinite(float(loss))
        assert float(grad[0, 2]) == 0.0
        keep = np.array([0, 1, 3])
        reduced = _loss(
            _inputs(
                logprobs[:, keep], old[:, keep], adv[:, keep], weights[:, keep], [[1, 1, 2]], ref[:, keep], ent[:, keep]
            ),
            config,
        )[0]
        assert float(loss) == pytest.approx(float(reduced), rel=1e-6)


def test_aggregation_path_coefficients_and_denominators_by_hand():
    # Two paths with 3 and 2 trained tokens; the batch's weights and path counts decide the denominator.
    tokens = np.array([3, 2])
    expected = {"token-mean": [1, 1], "seq-mean-token-mean": [1 / 3, 1 / 2], "seq-mean-token-sum-norm": [1 / 8, 1 / 8]}
    weights, paths = jnp.array([[1.0, 1.0, 2.0], [0.5, 0.0, 0.0]]), jnp.array([1.0, 1.0])
    for mode, coef in expected.items():
        config = LossConfig(aggregation=mode, norm_length=8)
        np.testing.assert_allclose(AGGREGATIONS[mode].path_coefficients(tokens, config, 3), coef)
        denominator = float(loss_denominator(weights, paths, config))
        assert denominator == (4.5 if mode == "token-mean" else 2.0)
    default_norm = AGGREGATIONS["seq-mean-token-sum-norm"].path_coefficients(tokens, LossConfig(), 3)
    np.testing.assert_allclose(default_norm, [1 / 3, 1 / 3])  # L defaults to the max_len given (the largest row)
    with pytest.raises(ValueError, match="path counts"):
        loss_denominator(weights, None, LossConfig(aggregation="seq-mean-token-mean"))


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_add_up_to_the_full_batch(mode):
    rng = np.random.default_rng(0)
    shape = (4, 6)
    weights = (rng.random(shape) > 0.3) * rng.integers(1, 3, shape)
    weights[2] = 0  # a row with nothing to train
    inputs = _inputs(
        -rng.random(shape),
        -rng.random(shape),
        rng.normal(size=shape),
        weights,
        rng.integers(0, 3, shape),
        -rng.random(shape),
        rng.random(shape),
    )
    config = LossConfig(policy_loss="gspo_turn", aggregation=mode, kl_coef=0.05, entropy_coef=0.01, dual_clip=2.0)
    denominator = loss_denominator(inputs.weights, jnp.asarray([2.0, 1.0, 0.0, 3.0]), config)

    def loss_of(part, logprobs):
        return compute_loss(part._replace(logprobs=logprobs), config).numerator / denominator

    full = jax.grad(lambda lp: loss_of(inputs, lp))(inputs.logprobs)
    full_metrics = compute_loss(inputs, config).metrics
    halves = [jax.tree.map(lambda x, s=s: x[s], inputs) for s in (slice(0, 2), slice(2, 4))]
    grads = [jax.grad(lambda lp, h=h: loss_of(h, lp))(h.logprobs) for h in halves]
    np.testing.assert_allclose(np.concatenate(grads), full, rtol=1e-5, atol=1e-7)
    summed = combine_metrics(*[compute_loss(h, config).metrics for h in halves])
    for name, (s, c) in full_metrics.items():
        assert float(summed[name][0]) == pytest.approx(float(s), rel=1e-5, abs=1e-6)
        assert float(summed[name][1]) == pytest.approx(float(c))


@pytest.mark.parametrize("name, value", [("reverse", 0.125), ("forward", np.exp(-0.5) + 0.5 - 1)])
def test_kl_to_reference_by_hand(name, value):
    # log π_θ − log π_ref = 0.5 on every trained token; the policy term is 0 (advantage 0).
    inputs = _inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], [[1.0, 1.0]], ref=[[-1.5, -1.5]])
    loss, metrics = _loss(inputs, LossConfig(kl_coef=0.2, kl=name))
    assert float(loss) == pytest.approx(0.2 * value, rel=1e-5)
    # The metric estimates the value KL(π_θ ‖ π_ref) (k3) whatever the penalty.
    assert finalize_metrics(metrics)["kl_ref"] == pytest.approx(np.exp(-0.5) + 0.5 - 1, rel=1e-5)


def _kl(p_log, q_log):
    return jnp.sum(jnp.exp(p_log) * (p_log - q_log))


@pytest.mark.parametrize(
    "name, kl_of",
    [("reverse", lambda logp, logq: _kl(logp, logq)), ("forward", lambda logp, logq: _kl(logq, logp))],
)
def test_kl_penalty_gradient_is_the_named_kl_gradient_by_exact_enumeration(name, kl_of):
    # Over a 7-token vocabulary: E_{y ~ π_θ}[∇ penalty(log π_θ(y) − log π_ref(y))], the expectation taken
    # exactly (sampling weights held fixed, as a loss on sampled tokens is), equals ∇ of the named KL.
    rng = np.random.default_rng(0)
    theta, ref = jnp.asarray(rng.normal(size=7)), jax.nn.log_softmax(jnp.asarray(rng.normal(size=7)))

    def expected_penalty(theta):
        logp = jax.nn.log_softmax(theta)
        return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * KL_PENALTIES[name](logp - ref))

    want = jax.grad(lambda t: kl_of(jax.nn.log_softmax(t), ref))(theta)
    assert float(jnp.abs(want).max()) > 1e-2  # a real gradient
    np.testing.assert_allclose(jax.grad(expected_penalty)(theta), want, rtol=1e-5, atol=1e-7)
    # The other option gives the other KL's gradient, which differs: the names are not interchangeable.
    other = "forward" if name == "reverse" else "reverse"
    swapped = jax.grad(
        lambda t: jnp.sum(jax.lax.stop_gradient(jax.nn.softmax(t)) * KL_PENALTIES[other](jax.nn.log_softmax(t) - ref))
    )(theta)
    assert float(jnp.abs(swapped - want).max()) > 1e-3


def test_k1_is_not_offered_because_its_expected_gradient_is_zero():
    rng = np.random.default_rng(1)
    theta, ref = jnp.asarray(rng.normal(size=7)), jax.nn.log_softmax(jnp.asarray(rng.normal(size=7)))
    k1 = lambda t: jnp.sum(jax.lax.stop_gradient(jax.nn.softmax(t)) * (jax.nn.log_softmax(t) - ref))
    np.testing.assert_allclose(jax.grad(k1)(theta), 0.0, atol=1e-6)
    with pytest.raises(ValueError, match="forward"):
        LossConfig(kl="k1")


def test_entropy_bonus_lowers_the_loss():
    inputs = _inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.0, 0.0]], [[1.0, 1.0]], entropies=[[2.0, 4.0]])
    loss, metrics = _loss(inputs, LossConfig(entropy_coef=0.1))
    assert float(loss) == pytest.approx(-0.1 * 3.0)
    assert finalize_metrics(metrics)["entropy"] == pytest.approx(3.0)


def _with_sequence_terms(inputs, paths, config, at_logprobs=None):
    """``inputs`` with gspo's per-token terms for ``paths`` at ``at_logprobs`` (default: ``inputs.logprobs``)."""
    at = inputs.logprobs if at_logprobs is None else at_logprobs
    seq_loss, seq_grad, metrics = sequence_terms(paths, np.asarray(at), np.asarray(inputs.old_logprobs), config)
    return inputs._replace(seq_loss=jnp.asarray(seq_loss), seq_grad=jnp.asarray(seq_grad)), metrics


def _row_paths(mask, advantages, coefficients):
    """Each row one path over its masked tokens."""
    rows, cols = np.nonzero(mask)
    t = mask.shape[1]
    return PathTokens(rows, rows * t + cols, np.asarray(advantages, np.float64)[rows, cols], np.asarray(coefficients))


def test_gspo_sequence_and_turn_ratios():
    # Row log-ratios 0.2, 0.4 in turn 1 and 0.0 in turn 2; advantage 1, clip wide open.
    log_ratio = np.array([[0.2, 0.4, 0.0]])
    inputs = _inputs(log_ratio - 1.0, -np.ones((1, 3)), np.ones((1, 3)), np.ones((1, 3)), [[1, 1, 2]])
    config = dict(clip_low=0.9, clip_high=10.0)
    gspo = LossConfig(policy_loss="gspo", **config)
    with pytest.raises(ValueError, match="path_tokens"):
        _loss(inputs, gspo)
    paths = _row_paths(np.ones((1, 3)), np.ones((1, 3)), [1.0])
    seq_inputs, seq = _with_sequence_terms(inputs, paths, gspo)
    assert finalize_metrics(seq)["ratio"] == pytest.approx(np.exp(0.2), rel=1e-5)  # exp(mean(0.2, 0.4, 0))
    _, turn = _loss(inputs, LossConfig(policy_loss="gspo_turn", **config))
    assert finalize_metrics(turn)["ratio"] == pytest.approx((2 * np.exp(0.3) + 1.0) / 3, rel=1e-5)
    # d loss / d log π_t = −A · s · (c |ℓ|) / |ℓ| / Σw with c = 1: −s / 3 on every token.
    loss, grad = jax.value_and_grad(lambda lp: _loss(seq_inputs._replace(logprobs=lp), gspo)[0])(inputs.logprobs)
    np.testing.assert_allclose(grad, -np.exp(0.2) / 3 * np.ones((1, 3)), rtol=1e-5)
    assert float(loss) == pytest.approx(-np.exp(0.2), rel=1e-5)


def test_gspo_gives_the_papers_sequence_level_gradient_with_seq_mean_token_mean():
    # GSPO (Zheng et al. 2025): J = 1/G Σ_i min(s_i A_i, clip(s_i) A_i), s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|).
    # A tiny policy (one logit vector per position, V = 3) and a group of sequences of lengths 3, 2, 1, 2,
    # enumerated by hand; one sequence's ratio is outside the clip range. Each row is one whole sequence.
    # Catches any drift of the sequence ratio's length normalisation (a sum for the mean in
    # sequences.sequence_terms).
    theta = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)), jnp.float32)
    old_theta = theta + jnp.asarray([[0.1, -0.2, 0.0], [0.0, 0.3, -0.1], [0.2, 0.0, 0.0]], jnp.float32)
    seqs = [[0, 2, 1], [1, 1], [2], [0, 0]]
    adv = np.array([1.0, -0.5, -1.0, 0.7], np.float32)
    clip = 0.02
    tokens = np.zeros((4, 3), np.int32)
    mask = np.zeros((4, 3), np.float32)
    for i, y in enumerate(seqs):
        tokens[i, : len(y)], mask[i, : len(y)] = y, 1.0
    lengths = mask.sum(1)

    def token_logprobs(th):
        logp = jax.nn.log_softmax(th, axis=-1)  # [position, V]
        return jnp.take_along_axis(logp[None].repeat(4, 0), tokens[..., None], axis=-1)[..., 0] * mask

    old = token_logprobs(old_theta)

    def paper(th):
        s = jnp.exp(jnp.sum(token_logprobs(th) - old, axis=1) / lengths)
        return jnp.mean(jnp.minimum(s * adv, jnp.clip(s, 1 - clip, 1 + clip) * adv))

    s = np.exp(np.sum(token_logprobs(theta) - old, axis=1) / lengths)
    assert np.any(np.abs(s - 1) > clip) and np.any(np.abs(s - 1) < clip), f"premise: clipped and unclipped, {s}"

    def ours(th, aggregation):
        # The sequence terms are taken at theta (the params the gradient is taken at), as the trainer does.
        config = LossConfig(policy_loss="gspo", clip_low=clip, clip_high=clip, aggregation=aggregation)
        coef = 1.0 / lengths if aggregation == "seq-mean-token-mean" else np.ones(4)
        inputs = LossInputs.from_advantages(
            token_logprobs(th), old, adv[:, None] * mask, coef[:, None] * mask, jnp.zeros((4, 3), jnp.int32)
        )
        paths = _row_paths(mask, adv[:, None] * mask, coef)
        inputs, _ = _with_sequence_terms(inputs, paths, config, at_logprobs=token_logprobs(theta))
        return _loss(inputs, config, paths=jnp.ones(4))[0]

    expected = -jax.grad(paper)(theta)  # our loss is −J
    assert float(jnp.abs(expected).max()) > 1e-3, "premise: a gradient to compare"
    np.testing.assert_allclose(jax.grad(ours)(theta, "seq-mean-token-mean"), expected, rtol=1e-5, atol=1e-7)
    assert float(ours(theta, "seq-mean-token-mean")) == pytest.approx(-float(paper(theta)), rel=1e-5)
    # token-mean weighs sequence i by |y_i| / mean |y| instead of 1: not the paper's gradient (documented).
    token_mean = jax.grad(ours)(theta, "token-mean")
    assert float(jnp.abs(token_mean - expected).max()) > 1e-3


def test_approx_kl_estimates_kl_old_to_new_on_old_samples():
    # Tokens sampled from π_old: k3 = (r − 1) − log r, r = π_θ / π_old, has E_old[k3] = KL(π_old ‖ π_θ) exactly.
    # Enumerate a 4-way categorical, each outcome weighted by its π_old probability. Catches the mutant "k3 for
    # samples from π_θ" (exp(−d) + d − 1, whose π_old-expectation is neither KL).
    old = np.array([0.5, 0.3, 0.15, 0.05])
    new = np.array([0.2, 0.3, 0.3, 0.2])
    exact = float(np.sum(old * np.log(old / new)))
    wrong = float(np.sum(old * (old / new - 1 + np.log(new / old))))  # the π_θ-sample k3 averaged over π_old
    assert abs(exact - wrong) > 0.05, "premise: the two estimators differ"
    inputs = _inputs(np.log(new)[None], np.log(old)[None], np.zeros((1, 4)), old[None])
    _, metrics = _loss(inputs, LossConfig())
    assert finalize_metrics(metrics)["approx_kl"] == pytest.approx(exact, rel=1e-5)


def test_approx_kl_under_a_truncated_behaviour_policy_is_kl_old_to_new():
    """π_old the top-2 truncation of a 4-way categorical (what top-k / top-p sampling draws from): approx_kl's
    π_old-expectation is KL(π_old ‖ π_θ) exactly. Fails with k3 there, whose expectation is KL + (kept mass − 1)
    (E_old[r] is the mass π_θ puts on the kept tokens, not 1)."""
    old = np.array([0.625, 0.375, 0.0, 0.0])  # top-2 of [0.5, 0.3, 0.15, 0.05], renormalised
    new = np.array([0.2, 0.3, 0.3, 0.2])
    kept = old > 0
    exact = float(np.sum(old[kept] * np.log(old[kept] / new[kept])))
    mass = float(new[kept].sum())
    assert abs(mass - 1.0) > 0.1  # premise: k3 would be off by mass − 1
    log_old = np.where(kept, np.log(np.where(kept, old, 1.0)), 0.0)
    inputs = _inputs(np.log(new)[None], log_old[None], np.zeros((1, 4)), old[None])
    _, metrics = _loss(inputs, LossConfig(), truncated_behaviour=True)
    assert finalize_metrics(metrics)["approx_kl"] == pytest.approx(exact, rel=1e-5)
    _, metrics = _loss(inputs, LossConfig())  # k3: KL + (mass − 1), what the untruncated estimator gives here
    assert finalize_metrics(metrics)["approx_kl"] == pytest.approx(exact + mass - 1.0, rel=1e-5)


def test_behaviour_gap_is_the_weighted_mean_absolute_log_ratio():
    """Fails if the gap is signed (the two tokens' gaps, +0.5 and −0.5, would cancel to 0) or unweighted."""
    new = np.log(np.array([[0.5, 0.2, 0.3]]))
    old = new + np.array([[-0.5, 0.5, 0.0]])
    inputs = _inputs(new, old, np.zeros((1, 3)), np.array([[1.0, 3.0, 0.0]]))
    _, metrics = _loss(inputs, LossConfig())
    assert finalize_metrics(metrics)["behaviour_gap"] == pytest.approx((0.5 * 1.0 + 0.5 * 3.0) / 4.0, rel=1e-5)


def test_non_finite_behaviour_logprobs_are_left_out_not_exploded():
    # A −inf or NaN behaviour log-prob (a sampler's, or a recomputation's) leaves its token untrained: the loss
    # and gradient are those of the other tokens. Catches the mutant "no masking" (the −inf token would add
    # ~exp(20)·|A| to the loss with zero gradient).
    logprobs = np.log([[0.5, 0.4, 0.3, 0.2]])
    old = np.log([[0.4, 0.4, 0.3, 0.3]])
    adv = [[1.0, -2.0, 1.5, 1.0]]
    config = LossConfig(kl_coef=0.1)
    ref = old + 0.1
    keep = [0, 2, 3]

    def numerator(lp, old_lp, adv_, weights, ref_):
        return compute_loss(_inputs(lp, old_lp, adv_, weights, ref=ref_), config).numerator

    lp = jnp.asarray(logprobs, jnp.float32)
    expected, expected_grad = jax.value_and_grad(numerator)(
        lp[:, keep], old[:, keep], np.asarray(adv)[:, keep], np.ones((1, 3)), ref[:, keep]
    )
    for bad in (-np.inf, np.nan):
        poisoned = old.copy()
        poisoned[0, 1] = bad
        loss, grad = jax.value_and_grad(numerator)(lp, poisoned, adv, np.ones((1, 4)), ref)
        assert np.isfinite(float(loss)) and float(loss) == pytest.approx(float(expected), rel=1e-6)
        np.testing.assert_allclose(np.asarray(grad)[:, keep], expected_grad, rtol=1e-6)
        assert float(grad[0, 1]) == 0.0


def test_config_errors_name_the_choices():
    with pytest.raises(ValueError, match="gspo_turn"):
        LossConfig(policy_loss="gspo-turn")
    with pytest.raises(ValueError, match="token-mean"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="clip_hi"):
        from_config(LossConfig, {"clip_hi": 0.3})
    inputs = _inputs([[-1.0]], [[-1.0]], [[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(inputs, LossConfig(kl_coef=0.1))
