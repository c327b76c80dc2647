import dataclasses

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.rl.trees import branching_tree, random_tree
from trace_jax.config_utils import from_config
from trace_jax.rl.advantages import ESTIMATORS, compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch, take_rows
from trace_jax.rl.losses import AGGREGATIONS, LossConfig, LossInputs, compute_loss, loss_denominator
from trace_jax.rollout.tree import RolloutTree


def test_path_rows_hold_the_sampled_ids_and_train_each_turn_once():
    tree = branching_tree()
    advantages = compute_advantages("grpo", [tree])
    config = BatchConfig(layout="paths", length_buckets=(16,), row_buckets=(4,))
    batch, info = build_batch([tree], advantages, config)
    assert batch.tokens.shape == (4, 16) and info.num_rows == 3
    for r, leaf in enumerate(tree.leaves()):
        ids = tree.prefix_ids(leaf)
        np.testing.assert_array_equal(batch.tokens[r, : ids.size], ids)  # token-in/token-out
        assert batch.lengths[r] == ids.size and info.layout.node[r, ids.size - 1] == leaf
        np.testing.assert_array_equal(batch.positions[r, : ids.size], np.arange(ids.size))
        np.testing.assert_array_equal(batch.predecessor[r, 1 : ids.size], np.arange(ids.size - 1))
    a_adv, b_adv = advantages[0].advantages[1], advantages[0].advantages[2]
    # Row of b: prompt (3) | a's turn (2, weight 2) | a's observation (2) | b's turn (1, weight 1)
    np.testing.assert_array_equal(batch.weights[0, :8], [0, 0, 0, 2, 2, 0, 0, 1])
    np.testing.assert_allclose(batch.advantages[0, 3:5], a_adv, rtol=1e-6)
    np.testing.assert_allclose(batch.advantages[0, 7], b_adv, rtol=1e-6)
    np.testing.assert_allclose(batch.old_logprobs[0, 3:5], [-0.5, -0.25])
    np.testing.assert_array_equal(batch.segment_ids[0, :8], [0, 0, 0, 1, 1, 0, 0, 2])
    # Row of c: a is context only (already trained by b's row); c's two tokens are trained.
    np.testing.assert_array_equal(batch.weights[1, :9], [0, 0, 0, 0, 0, 0, 0, 1, 1])
    # Row of d: prompt | d
    np.testing.assert_array_equal(batch.weights[2, :4], [0, 0, 0, 1])
    assert not batch.weights[3].any() and batch.lengths[3] == 0  # padding row
    assert info.num_trained_tokens == tree.num_sampled_tokens() == 6
    np.testing.assert_array_equal(batch.loss_mask, batch.weights > 0)
    np.testing.assert_array_equal(batch.paths, [1, 1, 1, 0])


def test_tree_rows_hold_each_token_once_with_path_positions_and_ancestor_visibility():
    tree = branching_tree()  # root (1 2 3) ─ a (10 11 | obs 90 91) ─ b (20), c (21 22); root ─ d (30)
    advantages = compute_advantages("grpo", [tree])
    config = BatchConfig(length_buckets=(16, 32), row_buckets=(1, 2), pack_length=32)
    batch, info = build_batch([tree, tree], advantages * 2, config)
    assert batch.tokens.shape == (1, 32) and info.num_tokens == 22 < info.num_path_tokens == 2 * 21
    first = slice(0, 11)
    np.testing.assert_array_equal(batch.tokens[0, first], [1, 2, 3, 10, 11, 90, 91, 20, 21, 22, 30])
    np.testing.assert_array_equal(batch.positions[0, first], [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 3])  # c, d continue
    # Keys stay visible to the end of their node's subtree: b's to b, c's to c, a's to c, the prompt's to d.
    np.testing.assert_array_equal(batch.visible_end[0, first], [11, 11, 11, 10, 10, 10, 10, 8, 10, 10, 11])
    # c's first token is predicted from a's last (observation) token, d's from the prompt's last.
    np.testing.assert_array_equal(batch.predecessor[0, first], [0, 0, 1, 2, 3, 4, 5, 6, 6, 8, 2])
    np.testing.assert_array_equal(batch.weights[0, first], [0, 0, 0, 2, 2, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(batch.tokens[0, 11:22], batch.tokens[0, first])  # the second tree
    assert batch.visible_end[0, 11] == 22 and batch.predecessor[0, 11] == 11  # sees nothing of the first
    adv = advantages[0]
    np.testing.assert_allclose(batch.adv_pos[0, 3] + batch.adv_neg[0, 3], 2 * adv.advantages[1], rtol=1e-6)
    assert batch.adv_pos[0, 3] > 0 > batch.adv_neg[0, 3]  # a has a winning and a losing leaf below
    assert batch.paths.sum() == 6


def test_observation_tokens_are_never_trained():
    rng = np.random.default_rng(1)
    trees = [random_tree(rng) for _ in range(6)]
    for layout in ("tree", "paths"):
        batch, info = build_batch(trees, compute_advantages("rloo", trees), BatchConfig(layout=layout))
        nodes = info.layout
        filled = nodes.tree >= 0
        turn_len = np.zeros(nodes.tree.shape, np.int64)
        turn_len[filled] = [
            trees[t][y].token_ids.size for t, y in zip(nodes.tree[filled], nodes.node[filled], strict=True)
        ]
        observation = filled & (nodes.offset >= turn_len)
        assert observation.sum() > 0 and not batch.weights[observation].any()


def _logprob(tokens, positions):
    # Current log-probs as a function of (token, path position) only, as a real policy's would be for equal
    # histories: a node shared by several paths gets the same log-probs wherever it is trained.
    return -0.05 * (tokens % 7) - 0.01 * positions - 0.3


def _batch_loss(batch, config):
    inputs = LossInputs(
        jnp.asarray(_logprob(batch.tokens, batch.positions)),
        jnp.asarray(batch.old_logprobs),
        jnp.asarray(batch.adv_pos),
        jnp.asarray(batch.adv_neg),
        jnp.asarray(batch.weights),
        jnp.asarray(batch.segment_ids),
    )
    denominator = loss_denominator(inputs.weights, jnp.asarray(batch.paths), config)
    return float(compute_loss(inputs, config).numerator / denominator)


def _per_path_loss(trees, advantages, config, max_len):
    """The objective from its definition, every root-to-leaf path trained on its own (no batch code): path ℓ
    weighs ``c_ℓ`` (token-mean 1, seq-mean-token-mean 1/|ℓ|, seq-mean-token-sum-norm 1/L), each of its sampled
    tokens adds PPO's ``max(−A·ρ, −A·clip(ρ))`` with A = A(ℓ, y); divided by Σ|ℓ| or by the number of paths."""
    total, tokens_total, paths = 0.0, 0, 0
    for tree, adv in zip(trees, advantages, strict=True):
        path_adv = adv.path_advantages(tree)
        for column, leaf in enumerate(tree.leaves()):
            terms = []
            for y in tree.path(leaf)[1:]:
                node = tree[y]
                for o, (token, old) in enumerate(zip(node.token_ids, node.sample_logprobs, strict=True)):
                    ratio = np.exp(_logprob(token, tree.prefix_length(node.parent) + o) - old)
                    a = path_adv[y, column]
                    clipped = np.clip(ratio, 1 - config.clip_low, 1 + config.clip_high)
                    terms.append(max(-a * ratio, -a * clipped))
            coef = {"token-mean": 1.0, "seq-mean-token-mean": 1.0 / len(terms)}.get(
                config.aggregation, 1.0 / (config.norm_length or max_len)
            )
            total += coef * sum(terms)
            tokens_total += len(terms)
            paths += 1
    return total / (tokens_total if config.aggregation == "token-mean" else paths)


@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_shared_turns_trained_once_give_the_per_path_loss(estimator, aggregation, layout):
    # Exact for every estimator and aggregation, clipping included (a tight clip so it is active). The reference
    # is written from the definition, not built by build_batch. Catches e.g. the mutant "seq-mean-token-mean's
    # coefficient 1 / (n + 1)" in losses.AGGREGATIONS, or a path advantage taken from the wrong leaf column.
    rng = np.random.default_rng(2)
    trees = [random_tree(rng, max_leaves=6) for _ in range(5)]
    advantages = compute_advantages(estimator, trees)
    config = LossConfig(clip_low=0.05, clip_high=0.05, aggregation=aggregation)
    batch_config = BatchConfig(layout=layout)
    shared, info = build_batch(trees, advantages, batch_config, config)
    assert info.num_path_tokens > info.num_tokens or layout == "paths", "premise: sharing happened"
    assert sum(len(t.leaves()) for t in trees) > info.num_rows or layout == "paths"
    reference = _per_path_loss(trees, advantages, config, batch_config.length_buckets[-1])
    assert abs(reference) > 1e-6, "premise: a loss to compare"
    assert _batch_loss(shared, config) == pytest.approx(reference, rel=1e-5)


def test_shapes_are_bucketed_and_padded_to_the_row_multiple():
    trees = [branching_tree() for _ in range(3)]  # 9 path rows of at most 9 tokens
    config = BatchConfig(layout="paths", length_buckets=(4, 16, 32), row_buckets=(8, 16), row_multiple=6)
    batch, info = build_batch(trees, compute_advantages("grpo", trees), config)
    assert batch.tokens.shape == (18, 16) and info.num_rows == 9
    np.testing.assert_array_equal(info.layout.tree[:9, 0], np.repeat([0, 1, 2], 3))
    assert (info.layout.tree[9:] == -1).all()
    packed, info = build_batch(trees, compute_advantages("grpo", trees), BatchConfig(length_buckets=(4, 16, 32)))
    assert packed.tokens.shape == (8, 16) and info.num_rows == 3  # one 11-token tree per 16-token row
    many = [branching_tree() for _ in range(40)]
    rows = build_batch(many, compute_advantages("grpo", many), BatchConfig(layout="paths", row_buckets=(8, 16)))
    assert rows[0].tokens.shape[0] == 128  # past the largest row bucket: a multiple of it


def test_row_padding_only_appends_rows_that_hold_nothing():
    rng = np.random.default_rng(0)
    trees = [branching_tree()] + [random_tree(rng) for _ in range(4)]
    advantages = compute_advantages("grpo", trees)
    config = BatchConfig(length_buckets=(16, 32), fixed_length=True, row_buckets=None)
    bare, info = build_batch(trees, advantages, config)
    assert bare.tokens.shape[0] == info.num_rows  # no row buckets, row multiple 1: no padding row
    padded, _ = build_batch(trees, advantages, dataclasses.replace(config, row_buckets=(8, 16), row_multiple=6))
    assert padded.tokens.shape[0] % 6 == 0 and padded.tokens.shape[0] > info.num_rows, "premise: padding rows"
    for name, a, b in zip(bare._fields, bare, padded, strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, np.asarray(b)[: info.num_rows], err_msg=name)
    assert (padded.lengths[info.num_rows :] == 0).all() and (padded.weights[info.num_rows :] == 0).all()


def test_fixed_length_gives_one_row_length_whatever_the_trees():
    config = BatchConfig(length_buckets=(4, 16, 32), fixed_length=True)
    small, big = [branching_tree()], [branching_tree() for _ in range(3)]
    shapes = {build_batch(t, compute_advantages("grpo", t), config)[0].tokens.shape[1] for t in (small, big)}
    assert shapes == {32}  # the largest bucket, though 16 would hold every row
    bucketed = dataclasses.replace(config, fixed_length=False)
    assert build_batch(small, compute_advantages("grpo", small), bucketed)[0].tokens.shape[1] == 16  # premise
    paths = dataclasses.replace(config, layout="paths", pack_length=None)
    assert build_batch(big, compute_advantages("grpo", big), paths)[0].tokens.shape[1] == 32


def test_take_rows_pads_with_rows_that_train_nothing_and_see_only_themselves():
    trees = [branching_tree() for _ in range(3)]
    batch, _ = build_batch(trees, compute_advantages("grpo", trees), BatchConfig(layout="paths"))
    taken = take_rows(batch, np.array([4, 1]), 5)
    assert taken.tokens.shape == (5, batch.tokens.shape[1]) and taken.ref_logprobs is None
    np.testing.assert_array_equal(taken.tokens[:2], batch.tokens[[4, 1]])
    np.testing.assert_array_equal(taken.weights[:2], batch.weights[[4, 1]])
    t = np.arange(batch.tokens.shape[1])
    assert (taken.weights[2:] == 0).all() and (taken.paths[2:] == 0).all() and (taken.lengths[2:] == 0).all()
    assert (taken.visible_end[2:] == t + 1).all() and (taken.predecessor[2:] == t).all()
    with pytest.raises(ValueError, match="do not fit"):
        take_rows(batch, np.arange(6), 5)


def test_too_long_rows_and_empty_batches_are_clear_errors():
    tree = branching_tree()
    with pytest.raises(ValueError, match="length_buckets"):
        build_batch([tree], compute_advantages("grpo", [tree]), BatchConfig(length_buckets=(4,)))
    flat = RolloutTree([1])
    flat.add_turn(0, [2], reward=1.0)
    flat.add_turn(0, [3], reward=1.0)
    with pytest.raises(ValueError, match="no rows"):
        build_batch([RolloutTree([1])], compute_advantages("grpo", [RolloutTree([1])]))
    skip = BatchConfig(skip_zero_advantage=True)
    _, info = build_batch([flat, tree], compute_advantages("grpo", [flat, tree]), skip)
    # flat's two one-token answers are its trained tokens, each on one path (token-mean weight 1).
    assert info.num_trees_skipped == 1 and info.num_rows == 1 and info.skipped_denominator == 2.0
    _, info = build_batch([flat], compute_advantages("grpo", [flat]), skip)  # no signal anywhere: nothing left out
    assert info.num_trees_skipped == 0 and info.num_rows == 1 and info.skipped_denominator == 0.0


def test_segment_weight_one_trains_each_turn_with_weight_one():
    tree = branching_tree()
    batch, _ = build_batch([tree], compute_advantages("grpo", [tree]), BatchConfig(segment_weight="one"))
    assert set(np.unique(batch.weights)) == {0.0, 1.0}
    with pytest.raises(ValueError, match="segment_weight"):
        BatchConfig(segment_weight="paths")


def test_batch_config_from_config_dict():
    config = from_config(BatchConfig, ml_collections.ConfigDict({"length_buckets": [8, 32], "segment_weight": "one"}))
    assert config.length_buckets == (8, 32) and config.segment_weight == "one"
    assert from_config(BatchConfig, None, row_multiple=4).row_multiple == 4
    with pytest.raises(ValueError, match="length_bucket"):
        from_config(BatchConfig, {"length_bucket": [8]})


def test_dr_grpo_length_is_one_constant_whatever_the_batch_longest_path():
    # seq-mean-token-sum-norm divides every path by one constant L: two batches whose longest paths differ weigh
    # every trained token the same (1 / L per path through it). Catches the mutant "L = the batch's longest path".
    short = [branching_tree()]
    long_tree = branching_tree()
    long_tree.add_turn(0, [40, 41, 42, 43, 44], logprobs=-np.ones(5), sample_logprobs=-np.ones(5), reward=1.0)
    loss = LossConfig(aggregation="seq-mean-token-sum-norm")
    config = BatchConfig(layout="paths", length_buckets=(16, 32))
    weights = []
    for trees in (short, [long_tree]):
        longest = max(sum(t[y].token_ids.size for y in t.path(leaf)[1:]) for t in trees for leaf in t.leaves())
        batch, _ = build_batch(trees, compute_advantages("grpo", trees), config, loss)
        weights.append((longest, batch.weights[0, 3]))  # a's first token: under two leaves in each tree
    (short_len, short_w), (long_len, long_w) = weights
    assert short_len != long_len, "premise: different longest paths"
    assert short_w == long_w == pytest.approx(2 / 32)  # two paths through it, L = the largest row length 32
    fixed = dataclasses.replace(loss, norm_length=10)
    batch, _ = build_batch([long_tree], compute_advantages("grpo", [long_tree]), config, fixed)
    assert batch.weights[0, 3] == pytest.approx(2 / 10)
    with pytest.raises(ValueError, match="norm_length"):
        LossConfig(norm_length=0)
