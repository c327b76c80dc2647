"""Tree-packed rows against the per-path reference on a real 2-layer Qwen3: log-probs and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.trees import random_tree
from trace_jax.models import ModelConfig, Qwen
from trace_jax.rl.advantages import ESTIMATORS, compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch, check_objective
from trace_jax.rl.logprobs import policy_logprobs
from trace_jax.rl.losses import AGGREGATIONS, LossConfig, LossInputs, compute_loss, loss_denominator
from trace_jax.rl.packing import pack_rows, tree_pieces
from trace_jax.rl.sequences import sequence_terms
from trace_jax.rollout.tree import RolloutTree

CONFIG = ModelConfig.preset(
    "qwen3-tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, head_dim=8
)
WIDTH = 48  # path rows and packed rows share it, so each jitted function compiles once


@functools.cache
def _setup():
    graphdef, params = nnx.split(Qwen(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(3)
    trees = [random_tree(rng, vocab=100, max_leaves=6) for _ in range(6)]
    assert any(t[y].depth >= 2 and len(t[y].children) > 1 for t in trees for y in range(len(t)))  # deep branching
    # Behaviour log-probs near the model's own (ratios spread around 1: both clip sides act).
    paths = _path_rows(trees)
    true = np.asarray(_path_logprobs(graphdef, params, jnp.asarray(paths["tokens"])))
    for row, (t, leaf) in enumerate(paths["leaf"]):
        tree = trees[t]
        for y, start in zip(tree.path(leaf), paths["starts"][row], strict=True):
            n = tree[y].token_ids.shape[0]
            if y:
                tree[y].sample_logprobs = true[row, start : start + n] + rng.normal(0, 0.3, n).astype(np.float32)
    return graphdef, params, trees


def _path_rows(trees):
    """Every leaf path as its own row, right-padded to WIDTH, with where each node starts."""
    tokens, leaf, starts = [], [], []
    for t, tree in enumerate(trees):
        for y in tree.leaves():
            ids = tree.prefix_ids(y)
            tokens.append(np.pad(ids, (0, WIDTH - ids.size)))
            leaf.append((t, y))
            starts.append(np.cumsum([0] + [tree[n].num_tokens for n in tree.path(y)])[:-1])
    return {"tokens": np.stack(tokens).astype(np.int32), "leaf": leaf, "starts": starts}


@functools.partial(jax.jit, static_argnums=0)
def _path_logprobs(graphdef, params, tokens_bt):
    """The reference: a plain causal forward per path row; entry t is log p(token t | tokens < t)."""
    logits = nnx.merge(graphdef, params)(tokens_bt).logits_btv
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(picked, ((0, 0), (1, 0)))


def _packed_batch(trees, estimator, loss, pack_length=24):
    config = BatchConfig(layout="tree", length_buckets=(WIDTH,), row_buckets=(8,), pack_length=pack_length)
    return build_batch(trees, compute_advantages(estimator, trees), config, loss)


def test_packing_splits_big_trees_and_fills_rows():
    _, _, trees = _setup()
    sizes = [sum(n.num_tokens for n in t) for t in trees]
    pieces = [tree_pieces(t, 24) for t in trees]
    assert any(len(p) > 1 for p in pieces) and max(sizes) > 24  # some tree is split over rows
    for tree in trees:
        for split in ("fewest", "each"):
            trained = [y for p in tree_pieces(tree, 24, split) for y, trains in p if trains]
            assert sorted(trained) == sorted({y for leaf in tree.leaves() for y in tree.path(leaf)})  # each once
    assert pack_rows([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]


def test_pieces_of_one_tree_in_one_row_share_their_context():
    """root(4) ─ A(4) ─┬─ B(4, leaf)      at capacity 18 the pieces are [root], [root A B], [root A C D1],
    └─ C(4) ─┬─ D1(6)  [root A C D2]: 52 tokens in 3 rows if each repeats its context; the
             └─ D2(6)  root piece costs nothing beside another piece of its tree."""
    tree = RolloutTree(np.arange(1, 5))
    turn = lambda parent, n, **kw: tree.add_turn(parent, np.full(n, 7), sample_logprobs=np.zeros(n), **kw)
    a = turn(0, 4)
    turn(a, 4, reward=1.0)
    c = turn(a, 4)
    turn(c, 6, reward=0.0)
    turn(c, 6, reward=1.0)
    pieces = tree_pieces(tree, 18)
    assert sum(len(p) for p in pieces) == 1 + 3 + 4 + 4  # premise: the split repeats context
    assert sum(tree[y].num_tokens for p in pieces for y, _ in p) == 52
    config = BatchConfig(length_buckets=(18,), row_buckets=None, pack_length=18)
    _, info = build_batch([tree], compute_advantages("grpo", [tree]), config)
    assert info.num_rows == 3 and info.num_tokens == 48
    layout = info.layout
    for r in range(info.num_rows):  # a row holds each node once
        nodes = layout.node[r][layout.node[r] >= 0]
        starts = nodes[np.r_[True, nodes[1:] != nodes[:-1]]]
        assert len(set(starts)) == len(starts)
    trains = layout.trains
    trained = list(zip(layout.node[trains].tolist(), layout.offset[trains].tolist(), strict=True))
    assert sorted(trained) == sorted({(y, o) for y in range(1, 6) for o in range(tree[y].token_ids.shape[0])})


def test_a_split_tree_fills_the_room_another_tree_leaves():
    """A (11 tokens: root 3, one turn of 8) fits a row of 20; B (root 3 + turns 6, 4, 8, 4 = 25) does not. Cut
    into one piece per turn, B's pieces share their root within a row, and one of them fills the 9 tokens A
    leaves: 2 rows, the fewest 36 tokens can take. Grouped into as few pieces as fit (3 + 8 + 6 and 3 + 4 + 4),
    B leaves pieces of 17 and 11 that share a row with nothing: 3 rows. The layout packs both, keeps the 2."""

    def star(root, turns):
        tree = RolloutTree(np.full(root, 5))
        for n in turns:
            tree.add_turn(0, np.full(n, 7), sample_logprobs=np.zeros(n), reward=float(n % 2 == 0))
        return tree

    trees = [star(3, [8]), star(3, [6, 4, 8, 4])]
    sizes = [sum(n.num_tokens for n in t) for t in trees]
    assert sizes == [11, 25] and sum(sizes) <= 2 * 20  # premise: B needs splitting; 2 rows could hold both
    assert [len(p) for p in tree_pieces(trees[1], 20, "each")] == [2, 2, 2, 2]  # one piece per turn
    assert [len(p) for p in tree_pieces(trees[1], 20, "fewest")] == [3, 3]  # premise: the other cut differs
    config = BatchConfig(length_buckets=(20,), row_buckets=None, pack_length=20)
    trees[1][1].reward, trees[1][2].reward = 1.0, 0.0  # B is mixed (A's lone leaf is kept too: no skip)
    _, info = build_batch(trees, compute_advantages("grpo", trees), config)
    assert info.num_rows == 2
    trained = info.layout.trains.sum()
    assert trained == 8 + 6 + 4 + 8 + 4  # every turn once
    # Padded to 4 rows either way (and 39 tokens either way): the tie keeps the fewest pieces, 3 rows.
    _, tied = build_batch(trees, compute_advantages("grpo", trees), dataclasses.replace(config, row_buckets=(4,)))
    assert tied.layout.tokens.shape[0] == 4 and (tied.num_rows, tied.num_tokens) == (3, 39) == (3, info.num_tokens)


def test_packed_logprobs_equal_the_per_path_ones():
    graphdef, params, trees = _setup()
    batch, info = _packed_batch(trees, "grpo", LossConfig())
    assert info.num_tokens < info.num_path_tokens  # shared prefixes are processed once
    assert any(len(set(row[row >= 0])) > 1 for row in info.layout.tree)  # several trees share a row
    packed = np.asarray(policy_logprobs(graphdef, params, jax.tree.map(jnp.asarray, batch), chunk=16)[0])
    paths = _path_rows(trees)
    reference = np.asarray(_path_logprobs(graphdef, params, jnp.asarray(paths["tokens"])))
    where = {}  # (tree, node, offset) -> reference log-prob, from every path holding it
    for row, (t, leaf) in enumerate(paths["leaf"]):
        for y, start in zip(trees[t].path(leaf), paths["starts"][row], strict=True):
            for o in range(trees[t][y].num_tokens):
                where[(t, y, o)] = reference[row, start + o]
    layout = info.layout
    checked = 0
    for r, c in zip(*np.nonzero(layout.tree >= 0), strict=True):
        key = (layout.tree[r, c], layout.node[r, c], layout.offset[r, c])
        if key[1] == 0 and key[2] == 0:
            continue  # a prompt's first token has no context
        np.testing.assert_allclose(packed[r, c], where[key], atol=1e-5, err_msg=str(key))
        checked += 1
    assert checked > 100


def _reference_inputs(trees, estimator, loss):
    """Per-path rows written from the definitions: advantage A(ℓ, y), behaviour log-prob, mask, turn id per
    token, the aggregation's path coefficient per row, and its denominator."""
    paths = _path_rows(trees)
    shape = paths["tokens"].shape
    adv, old, mask, node = (np.zeros(shape, np.float32) for _ in range(4))
    advantages = compute_advantages(estimator, trees)
    for row, (t, leaf) in enumerate(paths["leaf"]):
        tree = trees[t]
        a = advantages[t].path_advantages(tree)[:, tree.leaves().index(leaf)]
        for y, start in zip(tree.path(leaf)[1:], paths["starts"][row][1:], strict=True):
            n = tree[y].token_ids.shape[0]
            adv[row, start : start + n] = a[y]
            old[row, start : start + n] = tree[y].sample_logprobs
            mask[row, start : start + n] = 1.0
            node[row, start : start + n] = y
    lengths = mask.sum(1)
    coef = {"token-mean": np.ones_like(lengths), "seq-mean-token-mean": 1.0 / lengths}.get(
        loss.aggregation, np.full_like(lengths, 1.0 / (loss.norm_length or WIDTH))
    )
    denominator = lengths.sum() if loss.aggregation == "token-mean" else float(len(lengths))
    return paths["tokens"], adv, old, mask, node, coef.astype(np.float32), np.float32(denominator)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_value_and_grad(graphdef, loss, params, tokens, adv, old, mask, node, coef, denominator):
    low, high = 1.0 - loss.clip_low, 1.0 + loss.clip_high

    def fn(params):
        logp = _path_logprobs(graphdef, params, tokens)
        log_ratio = jnp.where(mask > 0, logp - old, 0.0)
        if loss.policy_loss == "gspo_turn":  # one ratio per turn: the mean log-ratio over the turn's tokens
            same = (node[:, :, None] == node[:, None, :]) & (mask[:, :, None] > 0) & (mask[:, None, :] > 0)
            turn = jnp.sum(same * log_ratio[:, None, :], -1) / jnp.maximum(same.sum(-1), 1)
            ratio = jnp.exp(jax.lax.stop_gradient(turn) + logp - jax.lax.stop_gradient(logp))
        elif loss.policy_loss == "gspo":  # one ratio per path, differentiated as it is: exp(mean log-ratio)
            length = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
            ratio = jnp.broadcast_to(jnp.exp(jnp.sum(log_ratio, -1, keepdims=True) / length), log_ratio.shape)
        else:
            ratio = jnp.exp(log_ratio)
        per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, low, high))
        return jnp.sum(coef[:, None] * mask * per_token) / denominator

    return jax.value_and_grad(fn)(params)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _packed_value_and_grad(graphdef, loss, params, batch, denominator):
    def fn(params):
        logprobs, _ = policy_logprobs(graphdef, params, batch, chunk=16)
        inputs = LossInputs(
            logprobs,
            batch.old_logprobs,
            batch.adv_pos,
            batch.adv_neg,
            batch.weights,
            batch.segment_ids,
            seq_loss=batch.seq_loss,
            seq_grad=batch.seq_grad,
        )
        return compute_loss(inputs, loss).numerator / denominator

    return jax.value_and_grad(fn)(params)


def _relative_error(a, b):
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    a, b = flat(a), flat(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo_turn", "gspo"])
def test_packed_gradient_equals_per_path_training_for_every_estimator_and_aggregation(policy_loss):
    """gspo: every path's sequence ratio over its trained tokens, shared-prefix tokens counted in every path
    through them, against the paper's form written on path rows. Fails if a shared token counts in one path
    only (relative gradient error 0.3 with each token in the first path through it)."""
    graphdef, params, trees = _setup()
    if policy_loss == "gspo":  # premise: with clip 0.1 some paths are clipped and some are not
        tokens, _, old, mask, *_ = _reference_inputs(trees, "grpo", LossConfig())
        logp = np.asarray(_path_logprobs(graphdef, params, jnp.asarray(tokens)))
        s = np.exp(np.sum(mask * (logp - old), 1) / mask.sum(1))
        assert np.any(np.abs(s - 1) > 0.1) and np.any(np.abs(s - 1) < 0.1), s
    checked = 0
    for estimator in sorted(ESTIMATORS):
        for aggregation in sorted(AGGREGATIONS):
            loss = LossConfig(policy_loss=policy_loss, aggregation=aggregation, clip_low=0.1, clip_high=0.1)
            check_objective(estimator, loss, BatchConfig())  # allowed
            batch, info = _packed_batch(trees, estimator, loss)
            if policy_loss == "gspo":  # the whole batch's log-probs at params give every path's ratio
                logprobs, _ = policy_logprobs(graphdef, params, jax.tree.map(jnp.asarray, batch), chunk=16)
                seq_loss, seq_grad, _ = sequence_terms(info.path_tokens, np.asarray(logprobs), batch.old_logprobs, loss)
                batch = batch._replace(seq_loss=seq_loss, seq_grad=seq_grad)
            reference = _reference_inputs(trees, estimator, loss)
            # The aggregation acts through the weights and the denominator only: one compile per policy loss.
            static = dataclasses.replace(loss, aggregation="token-mean")
            ref_value, ref_grad = _reference_value_and_grad(graphdef, static, params, *map(jnp.asarray, reference))
            batch = jax.tree.map(jnp.asarray, batch)
            denominator = loss_denominator(batch.weights, batch.paths, loss)
            value, grad = _packed_value_and_grad(graphdef, static, params, batch, denominator)
            assert np.linalg.norm(np.concatenate([np.ravel(g) for g in jax.tree.leaves(ref_grad)])) > 0.1  # a signal
            # float32 sums of signed terms: compare at 1e-4 relative or 1e-6 absolute (the gradient below is the spec)
            assert float(value) == pytest.approx(float(ref_value), rel=1e-4, abs=1e-6), (estimator, aggregation)
            assert _relative_error(grad, ref_grad) < 1e-5, (estimator, aggregation)
            checked += 1
    assert checked == len(ESTIMATORS) * len(AGGREGATIONS)


def test_disallowed_objectives_fail_at_config_time_and_say_what_to_use():
    check_objective("grpo", LossConfig(policy_loss="gspo"), BatchConfig())  # trainable on trees
    with pytest.raises(ValueError, match="gspo_turn"):
        check_objective("grpo", LossConfig(policy_loss="gspo"), BatchConfig(segment_weight="one"))
    with pytest.raises(ValueError, match="token-mean"):
        check_objective("grpo", LossConfig(aggregation="seq-mean-token-mean"), BatchConfig(segment_weight="one"))
    with pytest.raises(ValueError, match="advantage estimator"):
        check_objective("nope", LossConfig(), BatchConfig())
