"""The shared success predictor: it learns from backups, beats a depth-only baseline, and checkpoints."""

import numpy as np
import pytest

from trace_jax.allocation import predictor as P
from trace_jax.allocation.anchors import gather_anchors, training_anchors
from trace_jax.allocation.calibration import calibration_metrics
from trace_jax.allocation.simulate import Simulator, SimulatorConfig
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.tree import RolloutTree


def sampled_trees(sim, batch=32, k=4):
    trees = sim.sample_batch(batch)
    sim.continue_anchors([ContinuationRequest(t, 0, k) for t in trees])
    return trees


def small_mlp(**kw):
    return P.MLPPredictor(hidden=32, train_steps=16, batch_size=128, **kw)


def test_mlp_beats_depth_baseline_and_improves_with_more_trees():
    sim = Simulator(SimulatorConfig(num_prompts=1024), seed=0)
    held_out = training_anchors(sampled_trees(sim, batch=96))
    mlp, depth = small_mlp(seed=0), P.DepthPredictor()

    def score(model):
        return calibration_metrics(model.predict(held_out), held_out.targets_n, held_out.weights_n)

    mlp.update(training_anchors(sampled_trees(sim)))
    early = score(mlp)
    for _ in range(10):
        anchors = training_anchors(sampled_trees(sim))
        mlp.update(anchors)
        depth.update(anchors)
    late = score(mlp)
    assert late["brier"] < early["brier"]
    assert late["auc"] > score(depth)["auc"] + 0.1


def test_mlp_state_dict_round_trip_continues_identically():
    sim = Simulator(SimulatorConfig(num_prompts=256), seed=1)
    first, second = (training_anchors(sampled_trees(sim, batch=16)) for _ in range(2))
    model = small_mlp(seed=3)
    model.update(first)
    restored = small_mlp(seed=3)
    restored.load_state_dict(model.state_dict())
    np.testing.assert_allclose(restored.predict(second), model.predict(second), atol=1e-6)
    model.update(second)
    restored.update(second)  # same optimizer state and minibatch stream after the restore
    np.testing.assert_allclose(restored.predict(first), model.predict(first), atol=1e-5)


def test_a_second_predictor_reuses_the_compiled_training_step():
    # A new scheduler (resumed run, evaluation, a benchmark's second pass) builds a new predictor; its training
    # step must not compile again, or that compile lands inside a timed rollout phase.
    sim = Simulator(SimulatorConfig(num_prompts=256), seed=2)
    anchors = training_anchors(sampled_trees(sim, batch=16))
    first = small_mlp(seed=5)
    before = first.predict(anchors)
    first.update(anchors)
    assert np.abs(first.predict(anchors) - before).max() > 1e-4  # premise: the update trained the network
    compiled = P._train_step._cache_size()
    second = small_mlp(seed=6)
    second.update(anchors)
    assert P._train_step._cache_size() == compiled


def test_mlp_rejects_features_of_another_size():
    model = small_mlp(feature_dim=8)
    tree = RolloutTree([1])
    tree.root.feature = np.ones(5, np.float32)
    with pytest.raises(ValueError, match="size 5"):
        model.predict(gather_anchors([tree], [(0, 0)]))


def test_beta_posterior_ranks_prompts_it_has_seen_and_registry_names():
    easy, hard = RolloutTree([1], prompt_index=7), RolloutTree([1], prompt_index=9)
    for _ in range(4):
        easy.add_turn(0, [2], reward=1.0)
        hard.add_turn(0, [2], reward=0.0)
    beta = P.make_predictor("beta")
    beta.update(training_anchors([easy, hard]))
    pred = beta.predict(gather_anchors([easy, hard], [(0, 0), (1, 0)]))
    assert pred[0] > 0.7 > 0.3 > pred[1]
    restored = P.BetaPredictor()
    restored.load_state_dict(beta.state_dict())
    np.testing.assert_allclose(restored.predict(gather_anchors([easy], [(0, 0)])), pred[:1])
    with pytest.raises(ValueError, match="mlp"):
        P.make_predictor("unknown")


def test_beta_posterior_follows_a_task_to_another_batch_position():
    """A training step numbers its trees by batch position; the posterior must follow the prompt (its task id)."""
    first = [RolloutTree([1], {"id": "train-3"}, 0), RolloutTree([1], {"id": "train-8"}, 1)]
    for _ in range(4):
        first[0].add_turn(0, [2], reward=1.0)
        first[1].add_turn(0, [2], reward=0.0)
    beta = P.make_predictor("beta")
    beta.update(training_anchors(first))
    later = [RolloutTree([1], {"id": "train-8"}, 0), RolloutTree([1], {"id": "train-3"}, 1)]  # positions swapped
    assert [t.prompt_key for t in later] == [first[1].prompt_key, first[0].prompt_key] != [0, 1]
    pred = beta.predict(gather_anchors(later, [(0, 0), (1, 0)]))
    assert pred[0] < 0.3 < 0.7 < pred[1]


def test_mlp_waits_for_features_and_then_accepts_feature_less_anchors():
    bare = RolloutTree([1])
    bare.add_turn(0, [2], reward=1.0)
    model = small_mlp()
    assert model.predict(gather_anchors([bare], [(0, 0)])).tolist() == [0.5]
    assert model.update(training_anchors([bare])) == {}
    featured = RolloutTree([1])
    featured.root.feature = np.ones(3, np.float32)
    featured.add_turn(0, [2], reward=0.0)
    model.update(training_anchors([featured]))
    model.update(training_anchors([bare]))  # a later batch without features still trains
    assert 0.0 < model.predict(gather_anchors([bare], [(0, 0)]))[0] < 1.0


def move_trees(num, rng):
    """The first turn's token decides the odds (5: 90% success, 6: 10%); roots sit at 50%."""
    trees = []
    for i in range(num):
        tree = RolloutTree([1, 2, 3], prompt_index=i)
        for move in (5, 6):
            node = tree.add_turn(0, [move, 7, 7], observation_ids=[4])
            for _ in range(2):
                tree.add_turn(node, [8, 9], reward=float(rng.random() < (0.9 if move == 5 else 0.1)))
        trees.append(tree)
    return trees


def test_transformer_predictor_reads_the_prefix_tokens():
    rng = np.random.default_rng(0)
    model = P.make_predictor("transformer", model_overrides={"vocab_size": 16}, train_steps=20, max_len=16)
    for _ in range(4):
        model.update(training_anchors(move_trees(16, rng), with_prefix_ids=True))
    probe = move_trees(4, rng)
    pred = model.predict(gather_anchors(probe, [(0, 1), (0, 4), (0, 0)], with_prefix_ids=True))
    assert pred[0] > pred[2] > pred[1]
    restored = P.make_predictor("transformer", model_overrides={"vocab_size": 16}, max_len=16, seed=5)
    restored.load_state_dict(model.state_dict())
    again = restored.predict(gather_anchors(probe, [(0, 1), (0, 4), (0, 0)], with_prefix_ids=True))
    np.testing.assert_allclose(again, pred, atol=1e-6)
    with pytest.raises(ValueError, match="vocab_size"):
        P.make_predictor("transformer", model_overrides={"vocab_size": 4}).predict(
            gather_anchors(probe, [(0, 1)], with_prefix_ids=True)
        )


def _two_kinds_of_prompts(seed: int, num: int = 256, group: int = 8):
    """Root anchors of two prompt kinds with the same mean success, 0.5: "coin" prompts (each rollout a fair coin)
    and "all-or-nothing" ones (p is 0 or 1, half each). The features say the kind, never the outcome."""
    from trace_jax.allocation.anchors import AnchorBatch

    rng = np.random.default_rng(seed)
    coin = rng.integers(0, 2, num).astype(bool)
    centers = np.random.default_rng(0).normal(size=(2, 8)) * 2  # the same two kinds in every draw
    features = (centers[coin.astype(int)] + 0.3 * rng.normal(size=(num, 8))).astype(np.float32)
    successes = np.where(coin, rng.binomial(group, 0.5, num), group * rng.integers(0, 2, num))
    keys = np.arange(num, dtype=np.int64) + seed * num
    zeros = np.zeros(num, np.int64)
    anchors = AnchorBatch(features, np.ones(num, bool), zeros, keys, successes / group, np.full(num, float(group)))
    return anchors, coin


def test_dispersion_head_tells_all_or_nothing_prompts_from_coins_where_the_mean_cannot():
    from trace_jax.allocation.solvers import expected_root_value

    train, _ = _two_kinds_of_prompts(seed=1)
    test, coin = _two_kinds_of_prompts(seed=2)
    plain, spread = small_mlp(seed=0), small_mlp(seed=0, dispersion=True)
    for _ in range(15):
        plain.update(train)
        spread.update(train)
    # Premise: both kinds look alike to a mean-only predictor (p̂ ~ 0.5), so the plug-in V_root ties them.
    plain_value = expected_root_value(plain.predict(test), 0.0, 8)
    assert plain.predict_dispersion(test) is None
    assert abs(plain_value[coin].mean() - plain_value[~coin].mean()) < 0.05
    assert abs(spread.predict(test)[~coin].mean() - 0.5) < 0.1
    rho = spread.predict_dispersion(test)
    assert rho[~coin].mean() > 0.8 and rho[coin].mean() < 0.1
    # With the dispersion, a group of 8 of an all-or-nothing prompt is rarely mixed; a coin's nearly always.
    value = expected_root_value(spread.predict(test), rho, 8)
    assert value[~coin].max() < 0.3 < 0.9 < value[coin].min()


def test_dispersion_head_round_trips_through_its_state_dict():
    anchors, _ = _two_kinds_of_prompts(seed=3, num=64)
    model = small_mlp(seed=4, dispersion=True)
    model.update(anchors)
    restored = small_mlp(seed=4, dispersion=True)
    restored.load_state_dict(model.state_dict())
    np.testing.assert_allclose(restored.predict_dispersion(anchors), model.predict_dispersion(anchors), atol=1e-6)
    np.testing.assert_allclose(restored.predict(anchors), model.predict(anchors), atol=1e-6)
