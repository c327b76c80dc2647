import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import run_with_fake_devices
from tests.rl.trees import branching_tree, random_tree
from trace_jax.models import ModelConfig, Qwen
from trace_jax.optim import make_optimizer
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch
from trace_jax.rl.logprobs import policy_logprobs
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig
from trace_jax.rollout.engine.sampling import SamplingConfig
from trace_jax.rollout.tree import RolloutTree

# Smaller than qwen3-tiny to keep compiles short; the trees' token ids are all < 100.
CONFIG = ModelConfig.preset(
    "qwen3-tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8
)


def _model(seed=0):
    return Qwen(CONFIG, rngs=nnx.Rngs(seed))


# One length bucket and few row buckets: the batches of these tests share a shape, so a trainer compiles once.
BATCH_CONFIG = BatchConfig(length_buckets=(32,), row_buckets=(16, 32))


def _batch(seed=0, n_trees=3):
    rng = np.random.default_rng(seed)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(n_trees - 1)]
    return build_batch(trees, compute_advantages("grpo", trees), BATCH_CONFIG)[0]


def _path_batch(seed, n_trees):
    """One row per leaf path (more rows than packing gives, and a row count that varies with the trees)."""
    rng = np.random.default_rng(seed)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(n_trees - 1)]
    config = dataclasses.replace(BATCH_CONFIG, layout="paths")
    return build_batch(trees, compute_advantages("grpo", trees), config)[0]


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


@functools.cache
def shared_setup():
    """(graphdef, initial params, trainer) reused across tests so the step compiles once per process.

    The trainer's reference policy is the initial params; give ``init_state`` a copy (the state is donated).
    """
    graphdef, params = nnx.split(_model(), nnx.Param)
    return graphdef, params, _trainer(graphdef, reference_params=jax.tree.map(jnp.copy, params))


@functools.cache
def whole_batch_trainer():
    """A trainer whose update is one optimizer step over the whole batch in one micro-batch (shared: one compile)."""
    return _trainer(shared_setup()[0], update=WHOLE_BATCH)


def fresh_state(seed=0):
    _, params, trainer = shared_setup()
    return trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(seed))


# One optimizer step an update, its gradient accumulated over micro-batches of one row (one per batch shard).
ONE_STEP = UpdateConfig(ppo_epochs=1, mini_batches=1)
# One optimizer step on the whole batch in one micro-batch (the batches of these tests have at most 32 rows).
WHOLE_BATCH = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=32)


def _trainer(graphdef, eps=1e-8, learning_rate=1e-3, **kwargs):
    optimizer = make_optimizer(
        learning_rate=learning_rate, warmup_steps=0, total_steps=10, schedule="constant", eps=eps
    )
    kwargs.setdefault("update", ONE_STEP)
    return RLTrainer(graphdef, optimizer, kwargs.pop("loss", LossConfig()), **kwargs)


def _step(trainer, state, batch):
    """One ``update`` of ``batch`` as given (``prepare``'s output, or the sampler's log-probs used as they are)."""
    return trainer.update(state, batch, already_prepared=True)


def test_logprobs_match_the_model_and_do_not_depend_on_the_chunk():
    graphdef, params = nnx.split(_model(), nnx.Param)
    batch = jax.tree.map(jnp.asarray, _batch(n_trees=2))
    weights = jnp.asarray(np.random.default_rng(1).random(batch.tokens.shape), jnp.float32)

    def objective(chunk):
        def f(p):
            logprobs, entropies = policy_logprobs(graphdef, p, batch, chunk=chunk, entropy=True)
            return jnp.sum(weights * (logprobs + 0.1 * entropies)), (logprobs, entropies)

        return jax.jit(jax.grad(f, has_aux=True))

    (grads_1, stats_1), (grads_32, stats_32) = objective(5)(params), objective(32)(params)  # 5: 7 chunks, padded
    for a, b in zip(stats_1, stats_32, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_1), jax.tree.leaves(grads_32), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    logprobs, entropies = stats_1
    assert np.all(np.asarray(entropies)[np.asarray(batch.weights) > 0] > 0)
    assert np.all(np.asarray(entropies) <= np.log(CONFIG.vocab_size) + 1e-4)
    # Row 0 starts with branching_tree's prompt: token 1 (id 2) is predicted from token 0 (id 1).
    logp = jax.nn.log_softmax(_model()(batch.tokens[:1, :2]).logits_btv, axis=-1)
    np.testing.assert_allclose(logprobs[0, 1], logp[0, 0, batch.tokens[0, 1]], rtol=1e-5)
    assert logprobs[0, 0] == 0 and entropies[0, 0] == 0  # no context


def test_micro_batches_give_the_same_update():
    _, params, shared = shared_setup()
    batch = _path_batch(seed=1, n_trees=3)  # one row per path: rows for several micro-batches of one row
    results = []
    for trainer in (whole_batch_trainer(), shared):
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = _step(trainer, state, batch)
        results.append((_host(state.params), metrics))
    (p1, m1), (p2, m2) = results
    assert m1["micro_batches"] == 1 < m2["micro_batches"], "premise: one micro-batch against several"
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-5)
    assert m1["clip_fraction"] == pytest.approx(m2["clip_fraction"], abs=1e-6)
    assert m1["update_applied"] == 1.0


def test_training_raises_the_likelihood_of_the_better_leaf():
    _, _, trainer = shared_setup()
    tree = branching_tree()  # leaf b (node 2) succeeded, its sibling c (node 3) failed
    batch, _ = build_batch([tree], compute_advantages("grpo", [tree]), BATCH_CONFIG)
    state = fresh_state()
    before = np.asarray(trainer.logprobs(state.params, batch))
    first = None
    for _ in range(5):
        state, metrics = _step(trainer, state, trainer.prepare(state, batch, recompute_old_logprobs=True))
        first = first or metrics
    after = np.asarray(trainer.logprobs(state.params, batch))
    # Packed row: prompt 0-2 | a 3-4 | a's observation 5-6 | b 7 | c 8-9 | d 10.
    assert after[0, 7] > before[0, 7]  # b's token
    assert after[0, 8:10].sum() < before[0, 8:10].sum()  # c's tokens
    # First step on fresh log-probs: ratio 1, nothing clipped.
    assert first["ratio"] == pytest.approx(1.0, abs=1e-5) and first["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["clip_fraction"] == 0.0 and int(state.step) == 5
    assert "kl_ref" not in metrics and "entropy" not in metrics  # terms that are off cost nothing


def test_kl_term_uses_the_reference_and_reports_drift():
    graphdef, params, _ = shared_setup()
    trainer = _trainer(graphdef, loss=LossConfig(kl_coef=0.1), reference_params=params)
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    batch = _batch()
    state, first = _step(trainer, state, trainer.prepare(state, batch, recompute_old_logprobs=True))
    state, second = _step(trainer, state, trainer.prepare(state, batch, recompute_old_logprobs=True))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6) and second["kl_ref"] > 0
    assert shared_setup()[2].reference_params is None  # kl_coef = 0: no reference copy is kept


def test_ppo_epochs_move_the_ratio_and_the_clip_acts_at_a_large_learning_rate():
    graphdef, params, _ = shared_setup()
    update = UpdateConfig(ppo_epochs=2, mini_batches=1, behaviour_logprobs="recompute")
    trainer = _trainer(graphdef, learning_rate=3e-2, update=update)
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    state, metrics = trainer.update(state, _batch())
    assert metrics["steps"] == 2 and int(state.step) == 2 and metrics["update_applied"] == 1.0
    assert metrics["epoch1/ratio"] == pytest.approx(1.0, abs=1e-5) and metrics["epoch1/clip_fraction"] == 0.0
    assert abs(metrics["epoch2/ratio"] - 1.0) > 1e-3 and metrics["epoch2/clip_fraction"] > 0
    assert metrics["ratio_max"] >= metrics["epoch2/ratio_max"] > 1.0


def test_update_over_fixed_micro_batches_equals_one_step_on_the_whole_batch():
    graphdef, params, _ = shared_setup()
    batch = _path_batch(seed=0, n_trees=4)
    real = int((batch.lengths > 0).sum())
    assert real > 2 and real % 2, "premise: the rows split into micro-batches of 2 with a padded last one"
    whole = whole_batch_trainer()
    one = whole.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    batch = whole.prepare(one, batch, recompute_old_logprobs=True)  # the trees' own log-probs are made up
    one, reference = _step(whole, one, batch)
    assert reference["micro_batches"] == 1, "premise: the reference step is one micro-batch of the whole batch"
    trainer = _trainer(graphdef, update=UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=2))
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    state, metrics = trainer.update(state, batch)
    assert metrics["micro_batches"] == -(-real // 2) and metrics["steps"] == 1
    assert metrics["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    pairs = zip(jax.tree.leaves(_host(one.params)), jax.tree.leaves(params), strict=True)
    moved = [np.abs(a - b).max() for a, b in pairs]
    assert max(moved) > 1e-4, "premise: the step moved the params"
    for a, b in zip(jax.tree.leaves(_host(one.params)), jax.tree.leaves(_host(state.params)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_update_gives_the_same_params_whatever_padding_rows_the_batch_has():
    # The main job builds its batches without row padding (no row buckets, row multiple 1): update runs only the
    # rows that hold tokens, so a padded batch and an unpadded one of the same trees train identically.
    graphdef, params, _ = shared_setup()
    rng = np.random.default_rng(3)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(3)]
    advantages = compute_advantages("grpo", trees)
    padded, _ = build_batch(trees, advantages, dataclasses.replace(BATCH_CONFIG, row_multiple=4))
    bare, _ = build_batch(trees, advantages, dataclasses.replace(BATCH_CONFIG, row_buckets=None))
    real = int((bare.lengths > 0).sum())
    assert bare.tokens.shape[0] == real < padded.tokens.shape[0], "premise: padding rows to drop"
    update = UpdateConfig(ppo_epochs=2, mini_batches=2, micro_rows=2, behaviour_logprobs="recompute")
    results = []
    for batch in (padded, bare):
        trainer = _trainer(graphdef, update=update)
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = trainer.update(state, batch)
        results.append((_host(state.params), metrics))
    (padded_params, padded_metrics), (bare_params, bare_metrics) = results
    for a, b in zip(jax.tree.leaves(padded_params), jax.tree.leaves(bare_params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert padded_metrics == bare_metrics
    assert bare_metrics["steps"] == update.steps_per_batch == 4  # the optimizer steps one RL step makes


def test_update_compiles_its_programs_once_whatever_the_batch_size():
    graphdef, params, _ = shared_setup()
    update = UpdateConfig(ppo_epochs=2, mini_batches=2, micro_rows=2, behaviour_logprobs="recompute")
    trainer = _trainer(graphdef, update=update)
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    sizes, shapes = [], set()
    for seed, n_trees in ((0, 3), (1, 4), (2, 4)):
        batch = _path_batch(seed, n_trees)
        sizes.append(int((batch.lengths > 0).sum()))
        shapes.add(batch.tokens.shape)
        state, metrics = trainer.update(state, batch)
        if seed == 0:
            programs = {name: fn._cache_size() for name, fn in trainer._update_fns.items()}
            assert programs == {"zero": 1, "accumulate": 1, "apply": 1}
            behaviour = trainer._behaviour_fn._cache_size()
    assert len(set(sizes)) == 3 and len(shapes) == 2, f"premise: batches of several sizes, got {sizes}, {shapes}"
    assert {name: fn._cache_size() for name, fn in trainer._update_fns.items()} == programs
    assert trainer._behaviour_fn._cache_size() == behaviour == 1
    assert metrics["programs"] == 2  # (program, shape) pairs: behaviour log-probs and accumulate, one shape each
    with pytest.raises(ValueError, match="micro_rows"):
        UpdateConfig(micro_rows=-1)


def test_zero_micro_rows_runs_one_row_per_batch_shard():
    graphdef, params, _ = shared_setup()
    batch = _path_batch(seed=0, n_trees=4)
    real = int((batch.lengths > 0).sum())
    results = []
    for micro_rows in (0, 1):
        update = UpdateConfig(ppo_epochs=2, mini_batches=2, micro_rows=micro_rows, behaviour_logprobs="recompute")
        trainer = _trainer(graphdef, update=update)
        assert trainer.micro_rows == trainer.batch_shards == 1  # no mesh: one shard
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = trainer.update(state, batch)
        results.append((_host(state.params), metrics))
    (zero_params, zero_metrics), (one_params, one_metrics) = results
    assert real > 2 and zero_metrics["micro_batches"] == 2 * real  # a call per row, each of 2 epochs
    for a, b in zip(jax.tree.leaves(zero_params), jax.tree.leaves(one_params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert zero_metrics == one_metrics


def test_update_runs_epochs_times_mini_batches_steps_on_shuffled_rows():
    graphdef, params, _ = shared_setup()
    trainer = _trainer(graphdef, update=UpdateConfig(ppo_epochs=3, mini_batches=2, behaviour_logprobs="recompute"))
    state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    batch = _path_batch(seed=0, n_trees=3)
    assert (batch.lengths > 0).sum() >= 2, "premise: a row for each mini-batch"
    state, metrics = trainer.update(state, batch)
    assert metrics["steps"] == 6 and int(state.step) == 6
    assert {"epoch3/ratio", "epoch3/ratio_max", "epoch3/clip_fraction", "clip_fraction"} <= set(metrics)
    # The rows are shuffled into mini-batches, by shuffle_seed: another seed takes the same rows in another
    # order, so the params end elsewhere. Catches the mutant "no shuffle" (rows always in batch order).
    trainer.update_config = dataclasses.replace(trainer.update_config, shuffle_seed=1)  # same programs
    other = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
    other, other_metrics = trainer.update(other, batch)
    assert other_metrics["steps"] == 6
    moved = [
        np.abs(a - b).max()
        for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(_host(other.params)), strict=True)
    ]
    assert max(moved) > 1e-6
    with pytest.raises(ValueError, match="ppo_epochs"):
        UpdateConfig(ppo_epochs=0)
    with pytest.raises(ValueError, match="recompute"):
        UpdateConfig(behaviour_logprobs="untempered")


def _tempered_top_p(ids, temperature, top_p):
    """``(probs, keep)`` [len(ids), V] of the tiny model after each prefix of ``ids``, written from the
    definitions: ``softmax(logits / T)`` and the smallest set of most likely tokens holding ``top_p``."""
    logits = np.asarray(_model()(jnp.asarray([ids])).logits_btv[0], np.float64) / temperature
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    before = np.cumsum(np.take_along_axis(probs, order, -1), -1) - np.take_along_axis(probs, order, -1)
    keep = np.zeros(probs.shape, bool)
    np.put_along_axis(keep, order, before < top_p, -1)
    return probs, keep


def _trained_positions(tree, info, leaf):
    """(batch column, index along the leaf's path) of every token the batch trains on ``leaf``'s path (row 0)."""
    for column in np.nonzero(info.layout.trains[0])[0]:
        node = int(info.layout.node[0, column])
        if node and node in tree.path(leaf):
            yield column, tree.prefix_length(tree[node].parent) + int(info.layout.offset[0, column])


def test_recomputed_behaviour_logprobs_are_the_sampling_distribution_at_t07_top_p09():
    graphdef, params, _ = shared_setup()
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    trainer = _trainer(graphdef, sampling=sampling, update=UpdateConfig(behaviour_logprobs="recompute"))
    # The tiny model mostly copies its last token (probability ~1); after the prompt [7, 8] it is spread out
    # (top tokens 15, 101, 125 at about 0.38, 0.19, 0.09), so first-turn tokens sit in a truncated set of several.
    tree = RolloutTree([7, 8], task="q")
    turn = lambda parent, ids, **kw: tree.add_turn(parent, ids, logprobs=[-1.0] * len(ids), **kw)
    a = turn(0, [101, 101], observation_ids=[90, 91])
    turn(a, [91], reward=1.0)
    turn(a, [91, 5], reward=0.0)  # 5 is outside the kept set: -inf
    turn(0, [125], reward=0.0)
    batch, info = build_batch([tree], compute_advantages("grpo", [tree]), BATCH_CONFIG)
    old = np.asarray(trainer.prepare(trainer.init_state(params, jax.random.key(0)), batch).old_logprobs)
    checked, truncated = 0, 0
    for leaf in tree.leaves():
        ids = tree.prefix_ids(leaf)
        probs, keep = _tempered_top_p(ids, 0.7, 0.9)
        kept = np.where(keep, probs, 0.0)
        with np.errstate(divide="ignore"):
            table = np.log(kept / kept.sum(-1, keepdims=True))
        for column, t in _trained_positions(tree, info, leaf):
            np.testing.assert_allclose(old[0, column], table[t - 1, ids[t]], atol=1e-5)
            truncated += int(keep[t - 1].sum() < keep.shape[-1])
            checked += 1
    assert checked >= 6 and truncated == checked, "premise: top-p removes tokens at every checked position"
    trained = old[batch.weights > 0]
    assert np.isneginf(trained).any(), "premise: a sampled token outside the kept set"
    assert (np.isfinite(trained) & (trained < -0.05)).any(), "premise: a token inside a kept set of several"


def test_untruncated_behaviour_logprobs_make_the_first_ratio_one_where_truncated_ones_give_the_kept_mass():
    """At T = 0.7, top-p 0.9: "recompute" (the truncated sampling distribution) makes the first step's ratio of
    token t the mass top-p kept at t (π_T(y) / π_T,trunc(y)); "untruncated" makes it 1. Fails if
    "untruncated" recomputes under the sampling transform (ratio = kept mass < 1) or keeps the sampler's."""
    graphdef, params, _ = shared_setup()
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    trainer = RLTrainer(graphdef, _gradient_recorder(), LossConfig(), sampling=sampling)
    tree = RolloutTree([7, 8], task="q")
    turn = lambda parent, ids, **kw: tree.add_turn(parent, ids, logprobs=[-1.0] * len(ids), **kw)
    a = turn(0, [101, 101], observation_ids=[90, 91])
    turn(a, [91], reward=1.0)
    turn(0, [125], reward=0.0)
    turn(0, [15], reward=1.0)
    batch, info = build_batch([tree], compute_advantages("grpo", [tree]), BATCH_CONFIG)
    weights = np.asarray(batch.weights[0])
    mass = np.zeros_like(weights)
    for leaf in tree.leaves():
        ids = tree.prefix_ids(leaf)
        probs, keep = _tempered_top_p(ids, 0.7, 0.9)
        for column, t in _trained_positions(tree, info, leaf):
            assert keep[t - 1, ids[t]], "premise: every sampled token inside its kept set"
            mass[column] = probs[t - 1][keep[t - 1]].sum()
    trained = weights > 0
    assert trained.sum() >= 5 and np.all(mass[trained] > 0)
    assert mass[trained].min() < 0.95, "premise: top-p removes real mass somewhere"
    expected = float(np.sum(weights * mass) / weights.sum())
    ratios = {}
    for mode in ("recompute", "untruncated"):  # one trainer: the mode is read at each update
        trainer.update_config = UpdateConfig(ppo_epochs=1, mini_batches=1, behaviour_logprobs=mode)
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        _, metrics = trainer.update(state, batch)
        ratios[mode] = (metrics["ratio"], metrics["ratio_max"])
    assert ratios["recompute"][0] == pytest.approx(expected, abs=1e-5)
    assert ratios["recompute"][1] == pytest.approx(float(mass[trained].max()), abs=1e-5)
    assert ratios["untruncated"] == (pytest.approx(1.0, abs=1e-6), pytest.approx(1.0, abs=1e-6))


def test_non_finite_loss_skips_the_update_and_training_goes_on():
    _, _, trainer = shared_setup()
    state = fresh_state()
    batch = jax.device_get(trainer.prepare(state, _batch(), recompute_old_logprobs=True))
    before = _host(state.params)
    poisoned = batch._replace(adv_pos=np.where(batch.weights > 0, np.nan, 0.0).astype(np.float32))
    state, metrics = _step(trainer, state, poisoned)
    assert metrics["update_applied"] == 0.0 and metrics["skipped_steps"] == 1.0
    for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    state, metrics = _step(trainer, state, batch)
    assert metrics["update_applied"] == 1.0 and metrics["skipped_steps"] == 1.0 and int(state.step) == 2
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(before), strict=True)
    )


def test_missing_reference_and_greedy_sampling_are_clear_errors():
    graphdef, params = nnx.split(_model(), nnx.Param)
    state = _trainer(graphdef).init_state(params, jax.random.key(0))
    kl_trainer = _trainer(graphdef, loss=LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="reference_params"):
        kl_trainer.prepare(state, _batch())
    with pytest.raises(ValueError, match="greedy"):
        _trainer(graphdef, sampling=SamplingConfig.make_greedy())


@pytest.mark.slow
def test_sharded_step_matches_one_device():
    result = run_with_fake_devices("tests.rl.sharded_step_check", timeout=300)
    assert "SHARDED_OK" in result.stdout


@pytest.mark.slow
def test_two_slices_match_one_slice():
    # 4 fake CPU devices as 2 slices x fsdp 2 (per-slice gradients, summed once per step) against fsdp 4.
    result = run_with_fake_devices("tests.rl.multislice_check", timeout=300, devices=4)
    assert "MULTISLICE_OK" in result.stdout


def _gradient_recorder() -> optax.GradientTransformation:
    """An "optimizer" that never moves the params and sums every gradient it is given into its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, total, params=None: (jax.tree.map(jnp.zeros_like, grads), jax.tree.map(jnp.add, total, grads)),
    )


@pytest.mark.parametrize(
    "aggregation, policy_loss", [("token-mean", "ppo"), ("seq-mean-token-mean", "ppo"), ("seq-mean-token-mean", "gspo")]
)
def test_mini_batches_sum_to_the_full_batch_objective_and_gradient(aggregation, policy_loss):
    # Catches the mutant "each mini-batch divides by its own rows' Σ weights / path count": the mini-batch losses
    # then no longer sum to the full-batch loss (different path counts per mini-batch, shared-prefix tokens whose
    # paths end in the other mini-batch). gspo: every path's ratio comes from the whole batch before each step,
    # so a mini-batch's rows still see the ratios of paths that continue in the other one.
    graphdef, params, _ = shared_setup()
    rng = np.random.default_rng(5)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(5)]
    loss = LossConfig(aggregation=aggregation, policy_loss=policy_loss)
    # One row per path: a shared turn trains in the first row holding it, with the weight of every path through it.
    config = dataclasses.replace(BATCH_CONFIG, layout="paths")
    batch, info = build_batch(trees, compute_advantages("grpo", trees), config, loss)
    rows = np.flatnonzero(batch.lengths > 0)
    carried = batch.weights[rows].sum(1) / np.maximum((batch.weights[rows] > 0).sum(1), 1)
    assert rows.size >= 4 and carried.max() > carried.min(), "premise: rows carrying other rows' paths"
    results = []
    trainer = RLTrainer(graphdef, _gradient_recorder(), loss)
    for mini_batches in (1, 2):  # one trainer: the programs do not depend on the mini-batch count
        update = UpdateConfig(ppo_epochs=1, mini_batches=mini_batches, micro_rows=2, behaviour_logprobs="recompute")
        trainer.update_config = update
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = trainer.update(state, batch, info.path_tokens)
        assert metrics["steps"] == mini_batches and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        results.append((metrics["loss"], jax.tree.leaves(_host(state.opt_state))))
    (full_loss, full_grads), (split_loss, split_grads) = results
    assert split_loss == pytest.approx(full_loss, rel=1e-6, abs=1e-7)  # (0 at ratio 1 for seq-mean GRPO)
    flat = lambda leaves: np.concatenate([np.ravel(x) for x in leaves])
    full, split = flat(full_grads), flat(split_grads)
    assert np.abs(full).max() > 1e-4, "premise: a gradient to compare"
    np.testing.assert_allclose(split, full, rtol=1e-6, atol=1e-6 * np.abs(full).max())


def _all_equal_tree(reward: float, first: int) -> RolloutTree:
    """A prompt and two turns-then-answers with the same reward: every advantage 0 under GRPO."""
    tree = RolloutTree([1, first], task="equal")
    for ids in ([first + 1, first + 2], [first + 3]):
        lp = [-0.3] * len(ids)
        turn = tree.add_turn(0, ids, logprobs=lp, sample_logprobs=lp, observation_ids=[95])
        tree.add_turn(turn, [first + 4], logprobs=[-0.7], sample_logprobs=[-0.7], reward=reward)
    return tree


@pytest.mark.parametrize(
    "aggregation, policy_loss", [("token-mean", "ppo"), ("seq-mean-token-mean", "ppo"), ("seq-mean-token-mean", "gspo")]
)
def test_skipping_zero_advantage_trees_keeps_the_whole_batch_objective_and_gradient(aggregation, policy_loss):
    # Catches the mutant "the update divides by the kept rows' denominator only" (skipped_denominator not
    # added): the gradient is then the full one times D_all / D_kept, here at least 1.3x, not equal.
    graphdef, params, _ = shared_setup()
    rng = np.random.default_rng(7)
    trees = [branching_tree(), _all_equal_tree(1.0, 40), random_tree(rng), _all_equal_tree(0.0, 60), random_tree(rng)]
    loss = LossConfig(aggregation=aggregation, policy_loss=policy_loss)
    advantages = compute_advantages("grpo", trees)
    config = dataclasses.replace(BATCH_CONFIG, layout="paths")
    full_batch, full_info = build_batch(trees, advantages, config, loss)
    skip_batch, skip_info = build_batch(trees, advantages, dataclasses.replace(config, skip_zero_advantage=True), loss)
    assert skip_info.num_trees_skipped >= 2 and skip_info.num_rows < full_info.num_rows, "premise: trees left out"
    kept = float(skip_batch.paths.sum() if aggregation != "token-mean" else skip_batch.weights.sum())
    assert (kept + skip_info.skipped_denominator) / kept > 1.3, "premise: the skipped trees weigh in the mean"
    trainer = RLTrainer(graphdef, _gradient_recorder(), loss)
    trainer.update_config = UpdateConfig(ppo_epochs=1, mini_batches=1, micro_rows=2, behaviour_logprobs="recompute")
    results = []
    for batch, info in ((full_batch, full_info), (skip_batch, skip_info)):
        state = trainer.init_state(jax.tree.map(jnp.copy, params), jax.random.key(0))
        state, metrics = trainer.update(state, batch, info.path_tokens, info.skipped_denominator)
        results.append((metrics["loss"], jax.tree.leaves(_host(state.opt_state))))
    (full_loss, full_grads), (skip_loss, skip_grads) = results
    assert skip_loss == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
    flat = lambda leaves: np.concatenate([np.ravel(x) for x in leaves])
    full, skipped = flat(full_grads), flat(skip_grads)
    assert np.abs(full).max() > 1e-4, "premise: a gradient to compare"
    np.testing.assert_allclose(skipped, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


def test_no_tree_is_skipped_when_a_term_outside_the_advantage_trains_every_token():
    # Catches the mutant "skip whatever the loss": the KL / entropy / router terms of the left-out trees' tokens
    # would then be lost from the gradient.
    trees = [branching_tree(), _all_equal_tree(1.0, 40)]
    skip = dataclasses.replace(BATCH_CONFIG, skip_zero_advantage=True)
    _, info = build_batch(trees, compute_advantages("grpo", trees), skip)
    assert info.num_trees_skipped == 1, "premise: without such a term the all-equal tree is left out"
    for loss in (LossConfig(kl_coef=0.1), LossConfig(entropy_coef=0.01), LossConfig(router_aux_loss_coef=0.01)):
        _, info = build_batch(trees, compute_advantages("grpo", trees), skip, loss)
        assert info.num_trees_skipped == 0 and info.skipped_denominator == 0.0
