"""Routing record and replay: the engine records each sampled token's experts, the trees and rows carry the
record, and the trainer's forward replays it with gate values from its own router."""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from trace_jax.bench import routing
from trace_jax.models import PRESETS, MoeConfig, abstract_model, router_aux_loss
from trace_jax.models.moe import MoeBlock
from trace_jax.rl.advantages import compute_advantages
from trace_jax.rl.batch import BatchConfig, build_batch, take_rows
from trace_jax.rl.logprobs import policy_logprobs
from trace_jax.rl.losses import LossConfig, LossInputs, compute_loss, finalize_metrics
from trace_jax.rl.trainer import RLTrainer, _pooled_router_aux_loss
from trace_jax.rollout.backend import ContinuationRequest
from trace_jax.rollout.engine.engine import AppendItem, Engine, EngineConfig
from trace_jax.rollout.engine.mock import ToyEnv
from trace_jax.rollout.runner import RolloutRunner, RunnerConfig
from trace_jax.rollout.tree import ROOT, RolloutTree

CONFIG = MoeConfig.preset("qwen3-moe-tiny")  # 2 sparse layers, 4 experts, top-2


def _perturb_router(params, scale, seed=1):
    """``params`` with Gaussian noise of std ``scale`` on every router weight (a trainer that routes otherwise).
    The noise depends on ``seed`` and the weight's path only (``crc32``, not the per-process ``hash``)."""
    key = jax.random.key(seed)

    def one(path, x):
        name = jax.tree_util.keystr(path)
        if "router" not in name:
            return x
        return x + scale * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), x.shape)

    return jax.tree_util.tree_map_with_path(one, params)


@functools.cache
def _sampled():
    """(params, trees, batch): an fp32 engine recording the routing of 4 prompts x 8 sampled tokens."""
    params = routing.fresh_params(CONFIG, seed=0)
    engine = routing.recording_engine(CONFIG, prompts=4, tokens=8)
    trees = routing.sample_trees(engine, params, seed=0)
    return params, trees, routing.replay_batch(trees, length=engine.config.max_len)


def test_the_trees_hold_the_engines_record_of_what_the_engine_computed():
    """Fails if the engine records another step's experts or the packed output is read at the wrong columns:
    a forward of the sampled sequences with the same weights routes each sampled token as recorded."""
    params, trees, batch = _sampled()
    node = trees[0][1]
    assert node.routed_experts.shape == (node.token_ids.shape[0], *CONFIG.routing_shape)
    record = np.asarray(batch.routing)
    sampled = record[..., 0, 0] >= 0
    assert sampled.sum() == sum(t.num_sampled_tokens() for t in trees)  # premise: every sampled token recorded
    assert (record[~sampled] == -1).all()  # prompt tokens and padding carry no record
    fns = routing._trainer_fns(abstract_model(CONFIG)[0])
    own = np.asarray(fns[0](params, jax.tree.map(jnp.asarray, batch._replace(routing=None))))
    np.testing.assert_array_equal(np.sort(own[sampled], -1), np.sort(record[sampled], -1))


def test_replay_makes_the_trainers_selection_the_recorded_one():
    """Premise: a trainer whose router differs routes some sampled tokens to other experts (replay off).
    Replay on: zero differing decisions (fails if the record is ignored or read at the wrong layer), and the
    trainer's log-probs are closer to the sampler's, on average over four router perturbations (fails if the
    log-prob forward ignores the record: the two gaps are then equal). One perturbation is not enough: the
    gate values differ too, and on a single draw they can outweigh the replayed selection."""
    params, _, batch = _sampled()
    graphdef = abstract_model(CONFIG)[0]
    gaps = {False: [], True: []}
    for seed in range(4):
        trainer_params = _perturb_router(params, 0.3, seed=seed)
        off = routing.compare(graphdef, trainer_params, batch, replay=False)
        on = routing.compare(graphdef, trainer_params, batch, replay=True)
        assert off["decisions_differ"] > 0.05
        assert on["decisions_differ"] == 0.0 and on["tokens_differ"] == 0.0
        gaps[False].append(off["mean_abs_logprob_gap"])
        gaps[True].append(on["mean_abs_logprob_gap"])
    assert np.mean(gaps[True]) < 0.9 * np.mean(gaps[False])


def test_the_router_gets_a_gradient_under_replay():
    """Fails if replay takes the gate values from the record (constants) instead of the training router's
    probabilities of the recorded experts: every sparse layer's router must get a non-zero gradient."""
    params, _, batch = _sampled()
    graphdef = abstract_model(CONFIG)[0]
    rows = jax.tree.map(jnp.asarray, batch)
    assert rows.routing is not None  # premise: the forward replays

    def loss(p):
        return jnp.sum(policy_logprobs(graphdef, p, rows)[0] * rows.weights)

    grads = jax.grad(loss)(params)
    router = np.asarray(grads["moe_layers"]["mlp"]["router"].value)  # [sparse layers, d, experts]
    assert router.shape[0] == len(CONFIG.sparse_layers)
    assert all(np.abs(router[i]).max() > 1e-6 for i in range(router.shape[0]))


def test_rows_carry_the_record_at_every_place_a_sampled_token_sits_and_pad_with_no_record():
    """Packed rows (a turn that is context in one row and trained in another keeps its record in both) and
    padding rows with -1 (fails if padding rows get 0, which would replay expert 0 on them)."""
    k = CONFIG.routing_shape
    tree = RolloutTree([1, 2, 3])
    record = lambda n, e: np.full((n, *k), e, np.int32)
    a = tree.add_turn(ROOT, [4, 5], sample_logprobs=[-1.0, -1.0], observation_ids=[6], routed_experts=record(2, 1))
    tree.add_turn(a, [7], sample_logprobs=[-1.0], reward=1.0, routed_experts=record(1, 2))
    tree.add_turn(a, [8, 9], sample_logprobs=[-1.0, -1.0], reward=0.0, routed_experts=record(2, 3))
    config = BatchConfig(layout="paths", length_buckets=(16,), row_buckets=None)
    batch, _ = build_batch([tree], compute_advantages("grpo", [tree]), config)
    first = np.asarray(batch.routing)[:, :, 0, 0]
    np.testing.assert_array_equal(first[0, :7], [-1, -1, -1, 1, 1, -1, 2])
    np.testing.assert_array_equal(first[1, :8], [-1, -1, -1, 1, 1, -1, 3, 3])  # turn a as context: still 1
    assert np.asarray(batch.weights)[1, 3] == 0  # premise: row 1 holds turn a as untrained context
    padded = take_rows(batch, np.array([0]), 2)
    assert (np.asarray(padded.routing)[1] == -1).all()


def test_dense_models_refuse_routing():
    """A dense policy has no router: the engine and the model say so instead of ignoring the request."""
    dense = PRESETS["qwen3-tiny"]
    assert dense.routing_shape is None and CONFIG.routing_shape == (2, 2)
    with pytest.raises(ValueError, match="routing_replay"):
        Engine(abstract_model(dense)[0], dense, EngineConfig(routing_replay=True))
    graphdef, params = abstract_model(dataclasses.replace(dense, vocab_size=32))
    with pytest.raises(ValueError, match="no router"):
        jax.eval_shape(
            lambda p: nnx.merge(graphdef, p).forward_hidden(jnp.zeros((1, 2), jnp.int32), record_routing=True), params
        )


def _router_grads_and_metrics(coef, params, batch):
    graphdef = abstract_model(CONFIG)[0]
    trainer = RLTrainer(graphdef, optax.sgd(0.1), LossConfig(router_aux_loss_coef=coef))
    micro = jax.tree.map(jnp.asarray, batch)
    counts = trainer.router_counts(params, [micro], coef)
    assert (counts is None) == (coef == 0)
    grad_fn = jax.value_and_grad(trainer._loss_and_metrics, has_aux=True)
    (_, metrics), grads = grad_fn(params, micro, jnp.float32(1.0), counts)
    return np.asarray(grads["moe_layers"]["mlp"]["router"].value), finalize_metrics(_pooled_router_aux_loss(metrics))


def test_the_load_balancing_loss_changes_the_router_gradient_only_when_on():
    """Off (the default): the router's gradient is the policy loss's alone (fails if the term is always added);
    on: it differs by the gradient of coef x the load-balancing loss. Both log ``router_aux_loss``, the value
    of the replaying forward's statistics over the rows' real tokens (the value and gradient themselves are
    checked against transformers in ``tests/rl/test_router_aux_loss.py``)."""
    params, _, batch = _sampled()
    off, metrics_off = _router_grads_and_metrics(0.0, params, batch)
    on, metrics_on = _router_grads_and_metrics(1.0, params, batch)
    model = nnx.merge(abstract_model(CONFIG)[0], params)
    real = np.arange(batch.tokens.shape[1])[None] < np.asarray(batch.lengths)[:, None]
    _, _, out = model.forward_hidden(
        jnp.asarray(batch.tokens),
        positions_bt=jnp.asarray(batch.positions),
        kv_visible_end_bt=jnp.asarray(batch.visible_end),
        token_mask_bt=jnp.asarray(real),
        routing_btlk=jnp.asarray(batch.routing),
    )
    want = float(router_aux_loss(out.stats))
    assert want > 1.0  # premise: the experts are not perfectly balanced, so the loss has a gradient
    assert metrics_off["router_aux_loss"] == pytest.approx(want, rel=1e-5)
    assert metrics_on["router_aux_loss"] == pytest.approx(want, rel=1e-5)

    def policy_only(p):
        logprobs = policy_logprobs(abstract_model(CONFIG)[0], p, jax.tree.map(jnp.asarray, batch))[0]
        inputs = LossInputs(
            logprobs, batch.old_logprobs, batch.adv_pos, batch.adv_neg, batch.weights, batch.segment_ids
        )
        return compute_loss(inputs, LossConfig()).numerator

    reference = np.asarray(jax.grad(policy_only)(params)["moe_layers"]["mlp"]["router"].value)
    np.testing.assert_allclose(off, reference, rtol=1e-5, atol=1e-7)
    assert np.abs(on - off).max() > 1e-4


def test_the_runner_puts_each_turns_record_on_its_node_across_calls_and_forks():
    """Multi-turn trees from the real engine (turns spanning several ``generate`` calls, a fork from an
    anchor): each node's record is the teacher-forced routing of its own tokens (fails if the runner drops
    the record, misaligns a call's part or gives a fork its parent's record)."""
    config = dataclasses.replace(CONFIG, vocab_size=32)
    params = routing.fresh_params(config, seed=0)
    engine_config = EngineConfig(
        max_slots=2, max_len=48, steps_per_call=3, max_turn_tokens=5, length_buckets=(48,), row_buckets=(2,),
        weight_dtype=None, page_size=8, routing_replay=True,
    )  # fmt: skip
    engine = Engine(abstract_model(config)[0], config, engine_config)
    env = ToyEnv(max_turns=2, truncation_ends=False)
    runner = RolloutRunner(engine, params, env, RunnerConfig(seed=3))
    tree = RolloutTree(env.prompt_ids(1), task=1)
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 2)])
    inner = [a for a in tree.anchors() if a != ROOT]  # a turn EOS (id 1) ended is a leaf, not an anchor
    runner.continue_anchors([ContinuationRequest(tree, inner[0] if inner else ROOT, 1)])
    model = nnx.merge(abstract_model(config)[0], params)
    forward = jax.jit(lambda ids: model.forward_hidden(ids[None], record_routing=True)[2].experts_btlk[0])
    longest = 0
    for leaf in tree.leaves():
        ids = tree.prefix_ids(leaf)
        experts = np.asarray(forward(jnp.asarray(np.pad(ids, (0, 48 - len(ids))))))
        start = 0
        for node_id in tree.path(leaf):
            node = tree[node_id]
            n = len(node.token_ids)
            if node.parent is not None:
                assert node.routed_experts.shape == (node.num_tokens, *config.routing_shape)  # with its observation
                want = np.sort(experts[start : start + n], -1)
                np.testing.assert_array_equal(np.sort(node.routed_experts[:n], -1), want)
                longest = max(longest, n)
            start += node.num_tokens
    assert len(tree.leaves()) == 3 and longest > engine_config.steps_per_call  # premise: a turn spans calls


def test_replayed_experts_take_the_gate_values_of_the_recorded_experts():
    """Mutant M12 (replayed experts keep the gate values of the trainer's own top-k) fails here: a token whose
    record names other experts than its own top-k gets this router's probabilities of the recorded experts,
    renormalised, as its gates; a token without a record (-1) keeps its own top-k and gates."""
    config = dataclasses.replace(CONFIG, norm_topk_prob=True)
    graphdef, params = nnx.split(MoeBlock(config, nnx.Rngs(0)), nnx.Param)
    block = nnx.merge(graphdef, params)
    x = jax.random.normal(jax.random.key(1), (3, config.hidden_size))
    probs, own_w, own_i = block.route(x)
    # Record: token 0 the two experts its router ranks last, token 1 its second and last, token 2 none.
    order = np.argsort(-np.asarray(probs), axis=-1)
    record = np.stack([order[0, -2:], order[1, [1, -1]], [-1, -1]]).astype(np.int32)
    _, top_w, top_i = block.route(x, jnp.asarray(record))
    np.testing.assert_array_equal(np.asarray(top_i[:2]), record[:2])
    np.testing.assert_array_equal(np.asarray(top_i[2]), np.asarray(own_i[2]))
    for token in range(2):
        chosen = np.asarray(probs)[token, record[token]]
        assert set(record[token]) != set(np.asarray(own_i[token]))  # premise: replay changes the choice
        np.testing.assert_allclose(np.asarray(top_w[token]), chosen / chosen.sum(), rtol=1e-6)
        assert np.abs(np.asarray(top_w[token]) - np.asarray(own_w[token])).max() > 1e-3  # premise: gates differ
    np.testing.assert_allclose(np.asarray(top_w[2]), np.asarray(own_w[2]), rtol=1e-6)


def _context_engine(routing_replay=True, **overrides):
    """A tiny fp32 Qwen3-MoE engine (vocab 32) with 4-id append chunks, so a prompt spans several rows."""
    config = dataclasses.replace(CONFIG, vocab_size=32)
    engine_config = EngineConfig(
        max_slots=2, max_len=48, steps_per_call=3, max_turn_tokens=5, length_buckets=(48,), row_buckets=(2,),
        weight_dtype=None, page_size=8, append_chunk=4, routing_replay=routing_replay, **overrides,
    )  # fmt: skip
    return config, Engine(abstract_model(config)[0], config, engine_config)


@functools.cache
def _context_trees(routing_replay=True):
    """(config, params, tree): a prompt's roots featurized (prefill, held), two continuations (an append that
    starts from the held prompt, a fork), then one more from an inner anchor (started from its held history);
    observations appended between turns."""
    config, engine = _context_engine(routing_replay)
    params = routing.fresh_params(config, seed=0)
    env = ToyEnv(max_turns=2, truncation_ends=False)
    runner = RolloutRunner(engine, params, env, RunnerConfig(seed=3))
    tree = RolloutTree(np.arange(3, 14, dtype=np.int32), task=1)  # 11 ids: three 4-id append chunks
    runner.featurize_roots([tree])
    runner.continue_anchors([ContinuationRequest(tree, ROOT, 2)])
    inner = [a for a in tree.anchors() if a != ROOT]
    runner.continue_anchors([ContinuationRequest(tree, inner[0] if inner else ROOT, 1)])
    return config, params, tree


def _teacher_forced(config, params, ids, length=48):
    """int32 [len(ids), sparse layers, top-k]: the experts of a plain fp32 forward of ``ids`` (no cache)."""
    model = nnx.merge(abstract_model(config)[0], params)
    padded = jnp.asarray(np.pad(ids, (0, length - len(ids))))[None]
    return np.asarray(model.forward_hidden(padded, record_routing=True)[2].experts_btlk[0, : len(ids)])


def test_the_engine_records_the_routing_of_every_context_token():
    """Every token of the tree (prompt, sampled, observation) has one routing row, and it is the routing of a
    forward of its history with the same weights, whichever call computed it: the prompt's prefill (in 4-id
    chunks), appends started from held pages, forks, observation appends. Mutants this fails: context rows
    left unrecorded (the runner keeps the sampled tokens' records only: -1 rows on prompt / observations);
    an observation's (or a chunk's) routing taken from the wrong offset (rows of other tokens)."""
    config, params, tree = _context_trees()
    assert len(tree.leaves()) == 3 and any(len(tree[n].observation_ids) for n in range(len(tree)))  # premise
    for leaf in tree.leaves():
        ids = tree.prefix_ids(leaf)
        want = np.sort(_teacher_forced(config, params, ids), -1)
        got = np.concatenate([tree[n].routed_experts for n in tree.path(leaf)])
        assert got.shape == (len(ids), *config.routing_shape)  # a row for every token of the path
        assert (got >= 0).all()  # none unrecorded
        np.testing.assert_array_equal(np.sort(got, -1), want)


def test_the_trainers_rows_replay_every_token_as_the_engine_routed_it():
    """The packed rows' replay array has a record on every real token (no -1 sentinel outside padding), and
    the trainer's forward of those rows without replay, under the same weights, routes every token, context
    included, as recorded (fails if packing drops the context rows or shifts them by an offset); the tree
    saved and loaded (``to_dict`` / ``from_dict``) packs to the same array."""
    config, params, tree = _context_trees()
    batch_config = BatchConfig(length_buckets=(64,), row_buckets=None)
    for trees in ([tree], [RolloutTree.from_dict(tree.to_dict())]):
        batch, _ = build_batch(trees, compute_advantages("grpo", trees), batch_config)
        record = np.asarray(batch.routing)
        real = np.arange(record.shape[1])[None] < np.asarray(batch.lengths)[:, None]
        assert (record[real] >= 0).all() and (record[~real] == -1).all()
        assert (np.asarray(batch.weights)[real] == 0).sum() > 11  # premise: rows hold context tokens
        own = routing._trainer_fns(abstract_model(config)[0])[0](
            params, jax.tree.map(jnp.asarray, batch._replace(routing=None))
        )
        np.testing.assert_array_equal(np.sort(np.asarray(own)[real], -1), np.sort(record[real], -1))


def test_records_of_sampled_tokens_only_still_load_and_leave_the_context_unrecorded():
    """A tree saved with sampled-token records only (no observation rows) loads; packing replays its sampled
    tokens and marks the prompt and observations unrecorded (-1), so the trainer routes them itself. A
    record of any other length is refused."""
    k = CONFIG.routing_shape
    tree = RolloutTree([1, 2, 3])
    a = tree.add_turn(ROOT, [4, 5], sample_logprobs=[-1.0, -1.0], observation_ids=[6], routed_experts=np.ones((2, *k)))
    tree.add_turn(a, [7], sample_logprobs=[-1.0], reward=1.0, routed_experts=np.full((1, *k), 2))
    loaded = RolloutTree.from_dict(tree.to_dict())
    config = BatchConfig(layout="paths", length_buckets=(8,), row_buckets=None)
    batch, _ = build_batch([loaded], compute_advantages("grpo", [loaded]), config)
    np.testing.assert_array_equal(np.asarray(batch.routing)[0, :7, 0, 0], [-1, -1, -1, 1, 1, -1, 2])
    with pytest.raises(ValueError, match="routed_experts"):
        tree.add_turn(a, [8], observation_ids=[9], routed_experts=np.ones((3, *k)))
    # A later record of the observation fills its row; rows already recorded keep their first record.
    loaded.record_routing(a, np.full((3, *k), 5), start=4)
    np.testing.assert_array_equal(loaded[a].routed_experts[:, 0, 0], [1, 1, 5])


def test_without_routing_replay_the_engine_and_trees_are_as_before():
    """Routing replay off: the append program returns no record (two outputs, so it is the program a dense
    model runs), the trees carry none, and the sampler's tokens and log-probs are bit-identical to those of
    the recording engine (recording changes nothing the sampler computes). Mutant this fails: the append
    program returns the record whatever ``routing_replay`` says (an extra output and transfer when off)."""
    _, params, on = _context_trees()
    _, engine = _context_engine(routing_replay=False)
    state = engine.init_decode_state()
    engine.set_params(params)
    state, result = engine.append(None, state, [AppendItem(0, [3, 4, 5, 6, 7], reset=True)])
    assert result.routing is None and result.routing_spans is None
    args, window = (engine.params, state.device, np.zeros((8, 6), np.int32), np.zeros((8, 16), np.int32)), 16
    shapes = jax.eval_shape(engine.programs.jitted("append", static=(window,)), *args)
    assert len(shapes) == 2
    engine.free_resource(state, [0])
    _, _, off = _context_trees(routing_replay=False)
    assert all(node.routed_experts is None for node in off)
    assert [tuple(n.token_ids) for n in off] == [tuple(n.token_ids) for n in on]
    for a, b in zip(off, on, strict=True):
        np.testing.assert_array_equal(a.sample_logprobs, b.sample_logprobs)
        np.testing.assert_array_equal(a.observation_ids, b.observation_ids)
