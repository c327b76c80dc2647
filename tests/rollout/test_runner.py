"""The runner on the mock engine + toy env (hand-computed trees) and on the real tiny model (teacher forcing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.models import ModelConfig, Qwen
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.mock import (
    GOOD,
    MOCK_ENTROPY,
    MOCK_LOGPROB,
    MOCK_SAMPLE_LOGPROB,
    OBS,
    STOP_A,
    STOP_B,
    MockEngine,
    ToyEnv,
    mock_hidden,
    toy_policy,
)
from trace_jax.rollout.engine.sampling import SamplingConfig
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, RolloutTree


class RecordingMockEngine(MockEngine):
    """Records, at every generate call, how many slots are decoding and how many continuations were inserted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []
        self.inserted = 0

    def append(self, params, state, items):
        self.inserted += sum(item.reset for item in items)
        return super().append(params, state, items)

    def fork(self, state, sources, children, seeds, **kwargs):
        self.inserted += len(children)
        return super().fork(state, sources, children, seeds, **kwargs)

    def generate(self, params, state, refill_after=None):
        busy = sum(s is not None and s.reason == 0 for s in state.slots)
        self.calls.append((busy, self.inserted))
        return super().generate(params, state, refill_after)


def _mock_runner(max_slots=3, max_len=64, policy=toy_policy, turn_limit=8, env=None):
    config = EngineConfig(max_slots=max_slots, max_len=max_len, steps_per_call=4, max_turn_tokens=turn_limit)
    engine = RecordingMockEngine(config, policy)
    env = env or ToyEnv(max_turns=2)
    return RolloutRunner(engine, None, env, RunnerConfig(seed=0)), engine, env


def _trees(env, tasks):
    return [RolloutTree(env.prompt_ids(t), task=t, prompt_index=i) for i, t in enumerate(tasks)]


def test_root_rollouts_build_the_hand_computed_trees():
    runner, engine, env = _mock_runner()
    trees = _trees(env, [0, 1])
    stats = runner.continue_anchors([ContinuationRequest(t, ROOT, 4) for t in trees])
    for tree, seeds in zip(trees, [range(0, 4), range(4, 8)], strict=True):
        assert tree.leaf_counts()[ROOT] == 4 and len(tree) == 9
        moves = []
        for leaf in tree.leaves():
            _, first, last = tree.path(leaf)
            assert tree[last].depth == 2 and tree[first].depth == 1
            np.testing.assert_array_equal(tree[first].observation_ids, [OBS, 8])
            np.testing.assert_array_equal(tree[first].loss_mask, [1, 1, 1, 0, 0])
            assert tree[first].token_ids[1:].tolist() == [STOP_A, STOP_B]
            assert tree[last].reward == float(tree[last].token_ids[0] == GOOD)
            moves.append((tree[first].token_ids[0] == GOOD, tree[last].token_ids[0] == GOOD))
        assert sorted(moves) == sorted(((s & 1) == 1, (s >> 1) & 1 == 1) for s in seeds)
        np.testing.assert_allclose(tree.values()[ROOT], np.mean([(s >> 1) & 1 for s in seeds]))
        for node in tree:
            if not node.is_leaf:  # anchor feature = hidden state after the node's whole history
                np.testing.assert_array_equal(node.feature, mock_hidden(tree.prefix_ids(node.node_id)))
            if node.parent is not None:
                np.testing.assert_allclose(node.logprobs, MOCK_LOGPROB)
                np.testing.assert_allclose(node.sample_logprobs, MOCK_SAMPLE_LOGPROB)
                np.testing.assert_allclose(node.entropies, MOCK_ENTROPY)
    prompt_tokens = sum(len(t.root.token_ids) for t in trees)
    assert stats.rollouts == 8 and stats.generated_tokens == 8 * 2 * 3
    assert stats.forward_tokens == prompt_tokens + 8 * 2 * 3 + 8 * 2
    assert engine.counters["started_sequences"] == 2


def test_slots_are_refilled_while_continuations_are_queued():
    runner, engine, env = _mock_runner(max_slots=3)
    runner.continue_anchors([ContinuationRequest(t, ROOT, 4) for t in _trees(env, [0, 1])])
    assert engine.calls, "generate never ran"
    for busy, inserted in engine.calls:
        if inserted < 8:  # work still queued: no slot may sit idle
            assert busy == 3


def test_fork_at_a_turn_prefix_prefills_it_once_and_backs_up_values():
    runner, engine, env = _mock_runner()
    tree = _trees(env, [2])[0]
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 2)])  # seeds 0, 1: rewards bit 1 -> 0, 0
    anchor = tree.path(tree.leaves()[0])[1]
    started_before = engine.counters["started_sequences"]
    stats = runner.continue_anchors([ContinuationRequest(tree, anchor, 3)])  # seeds 2, 3, 4
    assert engine.counters["started_sequences"] == started_before + 1
    new_leaves = tree[anchor].children[1:]
    assert [tree[c].reward for c in new_leaves] == [float((s >> 1) & 1) for s in (2, 3, 4)]
    assert tree.leaf_counts()[anchor] == 4
    np.testing.assert_allclose(tree.values()[anchor], (0 + 1 + 1 + 0) / 4)
    # The anchor's history is held from stage 1 (its observation's append): only its last id is recomputed.
    assert stats.forward_tokens == 1 + 3 * 3


def test_turn_limit_truncates_and_the_env_ends_the_rollout():
    chatter = lambda history, turn, seed: 9  # never emits the stop pair
    runner, _, env = _mock_runner(policy=chatter, turn_limit=5)
    tree = _trees(env, [0])[0]
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 2)])
    for leaf in tree.leaves():
        assert tree[leaf].token_ids.tolist() == [9] * 5 and tree[leaf].reward == 0.0
        assert tree[leaf].info["stop_reason"] == "turn_limit" and tree[leaf].info["format_error"]


def test_full_context_ends_the_rollout_instead_of_overflowing():
    runner, _, env = _mock_runner(max_len=5, env=ToyEnv(max_turns=3))
    tree = _trees(env, [0])[0]  # 1 prompt token + 3 turn tokens: the 2-token observation no longer fits
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 1)])
    (leaf,) = tree.leaves()
    assert tree[leaf].depth == 1 and tree[leaf].info["forced_end"] == "context_exhausted"


def _tiny_engine_config(**fields):
    """A sampling engine for the real tiny model: 2 slots of 48 positions in pages of 8, fp32 weights (teacher
    forcing runs them too)."""
    base = dict(
        max_slots=2, max_len=48, steps_per_call=6, max_turn_tokens=4, length_buckets=(48,), row_buckets=(2,),
        sampling=SamplingConfig(temperature=1.3, top_k=20), weight_dtype=None, page_size=8,
    )  # fmt: skip
    return EngineConfig(**{**base, **fields})


def test_real_engine_records_the_policy_logprobs_and_features_teacher_forcing_reproduces():
    config = ModelConfig.preset("qwen3-tiny", vocab_size=32)
    model = Qwen(config, rngs=nnx.Rngs(0))
    params = nnx.split(model, nnx.Param)[1]
    engine = Engine.for_model(config, _tiny_engine_config())
    env = ToyEnv(max_turns=2, truncation_ends=False)
    runner = RolloutRunner(engine, params, env, RunnerConfig(seed=3))
    trees = _trees(env, [1, 2])
    runner.continue_anchors([ContinuationRequest(t, ROOT, 2) for t in trees])
    anchor = trees[0].path(trees[0].leaves()[0])[1]
    runner.continue_anchors([ContinuationRequest(trees[0], anchor, 2)])
    assert [t.leaf_counts()[ROOT] for t in trees] == [4, 2]
    forward = jax.jit(lambda ids: model(ids[None]))  # one padded shape: right padding leaves valid rows alone
    for tree in trees:
        for leaf in tree.leaves():
            ids = tree.prefix_ids(leaf)
            out = forward(jnp.asarray(np.pad(ids, (0, 48 - len(ids)))))
            logp = np.asarray(jax.nn.log_softmax(out.logits_btv[0], -1))
            start = 0
            for node_id in tree.path(leaf):
                node = tree[node_id]
                n = len(node.token_ids)
                if node.parent is not None:  # token at position p was predicted from position p - 1
                    expected = logp[np.arange(start - 1, start + n - 1), node.token_ids]
                    np.testing.assert_allclose(node.logprobs, expected, atol=2e-4)
                    assert np.isfinite(node.sample_logprobs).all()  # drawn inside the top-k support
                start += node.num_tokens
                if not node.is_leaf:
                    np.testing.assert_allclose(node.feature, np.asarray(out.hidden_btd[0, start - 1]), atol=2e-4)


def test_bad_requests_name_the_problem():
    runner, _, env = _mock_runner(max_len=8)
    tree = _trees(env, [0])[0]
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 1)])
    with pytest.raises(ValueError, match="leaf"):
        runner.continue_anchors([ContinuationRequest(tree, tree.leaves()[0], 1)])
    long_tree = RolloutTree(list(range(8)), task=0)
    with pytest.raises(ValueError, match="max_len"):
        runner.continue_anchors([ContinuationRequest(long_tree, ROOT, 1)])


def test_featurize_roots_matches_the_feature_a_rollout_would_record():
    engine = MockEngine(EngineConfig(max_slots=2, max_len=64, steps_per_call=4, max_turn_tokens=4), toy_policy)
    env = ToyEnv()
    featurized = [RolloutTree(env.prompt_ids(t), t, i) for i, t in enumerate(range(3))]
    RolloutRunner(engine, None, env).featurize_roots(featurized)
    sampled = [RolloutTree(env.prompt_ids(t), t, i) for i, t in enumerate(range(3))]
    RolloutRunner(engine, None, env).continue_anchors([ContinuationRequest(tree, 0, 1) for tree in sampled])
    for a, b in zip(featurized, sampled, strict=True):
        np.testing.assert_array_equal(a.root.feature, b.root.feature)


def test_runner_state_restores_the_seed_sequence():
    engine = MockEngine(EngineConfig(max_slots=2, max_len=64, steps_per_call=4, max_turn_tokens=4), toy_policy)
    env = ToyEnv()
    first = RolloutRunner(engine, None, env)
    first.continue_anchors([ContinuationRequest(RolloutTree(env.prompt_ids(0), 0), 0, 3)])
    resumed = RolloutRunner(engine, None, env)
    resumed.load_state_dict(first.state_dict())
    a, b = RolloutTree(env.prompt_ids(1), 1), RolloutTree(env.prompt_ids(1), 1)
    first.continue_anchors([ContinuationRequest(a, 0, 2)])
    resumed.continue_anchors([ContinuationRequest(b, 0, 2)])
    assert [a[i].token_ids.tolist() for i in a.leaves()] == [b[i].token_ids.tolist() for i in b.leaves()]


def test_new_weights_drop_the_held_prefixes_the_old_ones_computed():
    """Catches held pages that outlive a policy update (through the runner or straight on the shared engine): a
    continuation would start from keys and values of the old weights. The same weights again keep them."""

    def forward_tokens(update):
        runner, engine, env = _mock_runner()
        tree = _trees(env, [1])[0]
        runner.featurize_roots([tree])  # holds the root's history
        update(runner, engine)
        return runner.continue_anchors([ContinuationRequest(tree, ROOT, 1)]).forward_tokens, tree.root.num_tokens

    kept, prompt = forward_tokens(lambda runner, engine: None)
    same, _ = forward_tokens(lambda runner, engine: runner.set_params(engine.params))
    assert prompt > 1 and same == kept  # the premise: a hold saves all but the prompt's last id
    for update in (
        lambda runner, engine: runner.set_params({"w": 1}),
        lambda runner, engine: engine.set_params({"w": 1}),  # another runner of the engine updated it
        lambda runner, engine: runner.drop_held(),
    ):
        dropped, _ = forward_tokens(update)
        assert dropped == kept + prompt - 1  # the whole prompt prefilled again


def test_a_resumed_runner_continues_exactly_as_the_uninterrupted_one_after_new_weights():
    """Two phases on the real tiny engine with a KV pool too small for every hold, new weights between them (an
    RL step), against a fresh engine and runner restored from the runner's state after phase 1 (a resumed run):
    phase 2's trees (ids, log-probs) and what the job logs of it (forward tokens, evicted holds) must be equal.
    Fails if held prefix pages outlive new weights (``RolloutRunner.set_params`` keeping them): phase 1's holds
    then crowd the pool and the uninterrupted run's phase 2 evicts 8 of them (``rollout/evicted_holds`` in the
    job's metrics), the resumed one none. (On this CPU model the sampled trees stay equal either way.)"""
    config = ModelConfig.preset("qwen3-tiny", vocab_size=32)
    weights = [nnx.split(Qwen(config, rngs=nnx.Rngs(seed)), nnx.Param)[1] for seed in (0, 1)]
    # 13 usable pages: fewer than phase 1's holds and phase 2's together.
    engine_config = _tiny_engine_config(num_pages=14)
    env = ToyEnv(max_turns=2, truncation_ends=False)

    def phase(runner, tasks):
        trees = _trees(env, tasks)
        stats = [runner.continue_anchors([ContinuationRequest(t, ROOT, 2) for t in trees])]
        for tree in trees:  # continue from an inner node: a held history saves its prefill
            anchor = tree.path(tree.leaves()[0])[1]
            stats.append(runner.continue_anchors([ContinuationRequest(tree, anchor, 2)]))
        nodes = [(n.token_ids.tolist(), n.logprobs.tolist(), n.sample_logprobs.tolist()) for t in trees for n in t]
        return nodes, [s.forward_tokens for s in stats], runner.evicted_holds

    config_runner = RunnerConfig(seed=3, reuse_prefixes=True)
    runner = RolloutRunner(Engine.for_model(config, engine_config), weights[0], env, config_runner)
    phase(runner, [1, 2, 3])
    saved = runner.state_dict()
    assert runner.evicted_holds == 0 and len(runner._held) > 0, "premise: phase 1 ends holding prefixes"
    runner.set_params(weights[1])
    uninterrupted = phase(runner, [4, 5, 6])
    resumed_runner = RolloutRunner(Engine.for_model(config, engine_config), weights[1], env, config_runner)
    resumed_runner.load_state_dict(saved)
    resumed = phase(resumed_runner, [4, 5, 6])
    assert resumed == uninterrupted
