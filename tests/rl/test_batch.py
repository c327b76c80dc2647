import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.rl.trees import branching_tree, random_tree
from trace_jax.config_utils import from_config
from trace_jax.rl.advantages import NodeAdvantages, compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch, trees_to_batch
from trace_jax.rl.losses import LossConfig, LossInputs, compute_loss, loss_denominator
from trace_jax.rollout.tree import RolloutTree


def test_rows_hold_the_sampled_ids_and_train_each_turn_once():
    tree = branching_tree()
    advantages = compute_advantages("grpo", [tree])
    batch, info = build_batch([tree], advantages, BatchConfig(length_buckets=(16,), row_buckets=(4,)))
    assert batch.tokens.shape == (4, 16) and info.num_rows == 3
    for r, leaf in enumerate(tree.leaves()):
        ids = tree.prefix_ids(leaf)
        np.testing.assert_array_equal(batch.tokens[r, : ids.size], ids)  # token-in/token-out
        assert batch.lengths[r] == ids.size and info.leaf_id[r] == leaf
    a_adv, b_adv = advantages[0].advantages[1], advantages[0].advantages[2]
    # Row of b: prompt (3) | a's turn (2, weight 2) | a's observation (2) | b's turn (1, weight 1)
    np.testing.assert_array_equal(batch.weights[0, :8], [0, 0, 0, 2, 2, 0, 0, 1])
    np.testing.assert_allclose(batch.advantages[0, 3:5], a_adv)
    np.testing.assert_allclose(batch.advantages[0, 7], b_adv)
    np.testing.assert_allclose(batch.old_logprobs[0, 3:5], [-0.5, -0.25])
    np.testing.assert_array_equal(batch.segment_ids[0, :8], [0, 0, 0, 1, 1, 0, 0, 2])
    # Row of c: a is context only (already trained by b's row); c's two tokens are trained.
    np.testing.assert_array_equal(batch.weights[1, :9], [0, 0, 0, 0, 0, 0, 0, 1, 1])
    # Row of d: prompt | d
    np.testing.assert_array_equal(batch.weights[2, :4], [0, 0, 0, 1])
    assert not batch.weights[3].any() and batch.lengths[3] == 0  # padding row
    assert info.num_trained_tokens == tree.num_sampled_tokens() == 6
    np.testing.assert_array_equal(batch.loss_mask, batch.weights > 0)


def test_observation_tokens_are_never_trained():
    rng = np.random.default_rng(1)
    trees = [random_tree(rng) for _ in range(6)]
    batch, info = build_batch(trees, compute_advantages("rloo", trees))
    checked = 0
    for r in range(info.num_rows):
        tree, leaf = trees[info.tree_index[r]], info.leaf_id[r]
        observation = np.zeros(batch.tokens.shape[1], bool)
        position = 0
        for node_id in tree.path(leaf):
            node = tree[node_id]
            position += node.token_ids.size
            observation[position : position + node.observation_ids.size] = True
            position += node.observation_ids.size
        checked += observation.sum()
        assert not batch.weights[r, observation].any()
    assert checked > 0


def _paths_as_trees(tree: RolloutTree, adv: NodeAdvantages):
    """The undeduplicated view: one chain tree per leaf, each node keeping its advantage, weight 1."""
    trees, advs = [], []
    for leaf in tree.leaves():
        chain = RolloutTree(tree.root.token_ids)
        values, parent = [0.0], 0
        for node_id in tree.path(leaf)[1:]:
            node = tree[node_id]
            parent = chain.add_turn(
                parent, node.token_ids, node.logprobs, observation_ids=node.observation_ids, reward=node.reward
            )
            values.append(adv.advantages[node_id])
        trees.append(chain)
        advs.append(NodeAdvantages(np.asarray(values, np.float32), np.r_[0.0, np.ones(len(values) - 1)]))
    return trees, advs


def _batch_loss(batch, config):
    # Current log-probs as a function of (token, position) only, as a real policy's would be for equal
    # histories: a node shared by several rows gets the same log-probs in each of them.
    position = jnp.arange(batch.tokens.shape[1])[None, :]
    logprobs = -0.05 * (batch.tokens % 7) - 0.01 * position - 0.3
    inputs = LossInputs(
        logprobs,
        jnp.asarray(batch.old_logprobs),
        jnp.asarray(batch.advantages),
        jnp.asarray(batch.weights),
        jnp.asarray(batch.segment_ids),
    )
    return float(compute_loss(inputs, config).numerator / loss_denominator(inputs.weights, config))


@pytest.mark.parametrize("estimator", ["treerl", "node_value"])
def test_dedup_batch_equals_training_every_path(estimator):
    # For node-constant advantages the deduplicated loss equals the per-path loss exactly, clipping included.
    rng = np.random.default_rng(2)
    trees = [random_tree(rng, max_leaves=6) for _ in range(5)]
    advantages = compute_advantages(estimator, trees)
    dedup, _ = build_batch(trees, advantages)
    split = [_paths_as_trees(t, a) for t, a in zip(trees, advantages, strict=True)]
    path_trees = [c for trees_, _ in split for c in trees_]
    path_advs = [a for _, advs in split for a in advs]
    per_path, _ = build_batch(path_trees, path_advs)
    assert (per_path.weights > 0).sum() > (dedup.weights > 0).sum()  # sharing happened
    config = LossConfig(clip_low=0.05, clip_high=0.05)  # tight clip so clipping is active
    assert _batch_loss(dedup, config) == pytest.approx(_batch_loss(per_path, config), rel=1e-5)


def test_shapes_are_bucketed_and_padded_to_the_row_multiple():
    trees = [branching_tree() for _ in range(3)]  # 9 rows of at most 9 tokens
    config = BatchConfig(length_buckets=(4, 16, 32), row_buckets=(8, 16), row_multiple=6)
    batch, info = build_batch(trees, compute_advantages("grpo", trees), config)
    assert batch.tokens.shape == (18, 16) and info.num_rows == 9
    np.testing.assert_array_equal(info.tree_index[:9], np.repeat([0, 1, 2], 3))
    assert (info.tree_index[9:] == -1).all()


def test_too_long_rows_and_empty_batches_are_clear_errors():
    tree = branching_tree()
    with pytest.raises(ValueError, match="length_buckets"):
        build_batch([tree], compute_advantages("grpo", [tree]), BatchConfig(length_buckets=(4,)))
    flat = RolloutTree([1])
    flat.add_turn(0, [2], reward=1.0)
    flat.add_turn(0, [3], reward=1.0)
    with pytest.raises(ValueError, match="no rows"):
        build_batch([flat], compute_advantages("grpo", [flat]), BatchConfig(skip_zero_advantage=True))
    _, info = build_batch([flat, tree], compute_advantages("grpo", [flat, tree]), BatchConfig(skip_zero_advantage=True))
    assert info.num_trees_skipped == 1 and info.num_rows == 3


def test_segment_weight_one_trains_each_turn_with_weight_one():
    tree = branching_tree()
    batch, _ = build_batch([tree], compute_advantages("grpo", [tree]), BatchConfig(segment_weight="one"))
    assert set(np.unique(batch.weights)) == {0.0, 1.0}
    with pytest.raises(ValueError, match="segment_weight"):
        BatchConfig(segment_weight="paths")


def test_trees_to_batch_is_advantages_then_rows():
    trees = [branching_tree(), branching_tree()]
    batch, info, advantages = trees_to_batch(trees, "rloo")
    expected, _ = build_batch(trees, compute_advantages("rloo", trees))
    np.testing.assert_array_equal(batch.advantages, expected.advantages)
    assert len(advantages) == 2 and info.num_rows == 6


def test_batch_config_from_config_dict():
    config = from_config(BatchConfig, ml_collections.ConfigDict({"length_buckets": [8, 32], "segment_weight": "one"}))
    assert config.length_buckets == (8, 32) and config.segment_weight == "one"
    assert from_config(BatchConfig, None, row_multiple=4).row_multiple == 4
    with pytest.raises(ValueError, match="length_bucket"):
        from_config(BatchConfig, {"length_bucket": [8]})
