"""The decode engine on a tiny Qwen3: exactness against transformers, forks, extend, stops and slot reuse."""

import numpy as np
import pytest
import torch
from flax import nnx

from tests.helpers import build_hf_checkpoint
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models.qwen import Qwen, abstract_model
from trace_jax.rollout.engine import Engine, EngineConfig, StopReason
from trace_jax.rollout.sampling import SamplingConfig

GREEDY = SamplingConfig.make_greedy()
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [7, 7, 7, 30]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    reference = build_hf_checkpoint(path, "qwen3", vocab_size=128)
    config, params = load_hf(path)
    return reference, config, params


def _engine(config, **fields) -> Engine:
    # min_bucket = max_len: one program per entry point (windows and buckets get their own test below).
    base = dict(max_slots=4, max_len=64, steps_per_call=12, max_turn_tokens=12, min_bucket=64, sampling=GREEDY)
    return Engine(abstract_model(config)[0], config, EngineConfig(**{**base, **fields}))


@pytest.fixture(scope="module")
def greedy(checkpoint):
    return _engine(checkpoint[1])


def _run(engine, params, prompts, seeds=None, slots=None, **generate_kw):
    """Prefills ``prompts`` in one call, inserts them into ``slots`` and generates once."""
    state = engine.init_decode_state(**generate_kw.pop("stops", {}))
    slots = list(range(len(prompts))) if slots is None else slots
    prefix = engine.prefill_many(params, prompts)
    seeds = [0] * len(prompts) if seeds is None else seeds
    state = engine.insert_rows(prefix, state, list(range(len(prompts))), slots, seeds, generate_kw.pop("limit", None))
    return engine.generate(params, state, **generate_kw)


def _turn(out, slot):
    return out.tokens[slot, : out.num_tokens[slot]].tolist()


def test_greedy_equals_transformers_generate_for_prompts_of_different_lengths(checkpoint, greedy):
    reference, _, params = checkpoint
    _, out = _run(greedy, params, PROMPTS)
    for slot, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ids = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert _turn(out, slot) == ids[0, len(prompt) :].tolist()
        assert out.stop_reason[slot] == StopReason.TURN_LIMIT
        np.testing.assert_allclose(out.sample_logprobs[slot, :12], 0.0)
        assert (out.logprobs[slot, :12] < 0).all()


def test_fork_equals_independent_runs_and_prefills_once(checkpoint):
    _, config, params = checkpoint
    engine = _engine(config, sampling=SamplingConfig(temperature=1.0))
    prompt, seeds = PROMPTS[0], [3, 4, 5]
    state = engine.init_decode_state()
    state = engine.bulk_insert(engine.prefill(params, prompt), state, [1, 2, 3], seeds)
    assert engine.counters["prefill_sequences"] == 1
    _, forked = engine.generate(params, state)
    turns = {tuple(_turn(forked, s)) for s in (1, 2, 3)}
    assert len(turns) > 1, "different seeds should give different continuations"
    for slot, seed in zip([1, 2, 3], seeds, strict=True):
        _, alone = _run(engine, params, [prompt], seeds=[seed], slots=[0])
        assert _turn(alone, 0) == _turn(forked, slot)
        np.testing.assert_allclose(alone.logprobs[0], forked.logprobs[slot], atol=1e-5)
        np.testing.assert_allclose(alone.hidden[0], forked.hidden[slot], atol=1e-5)


def test_prefill_then_extend_equals_prefill_of_concatenation(checkpoint, greedy):
    _, _, params = checkpoint
    head, tail = PROMPTS[0], [40, 41, 42, 43, 44]
    state = greedy.init_decode_state()
    state = greedy.insert_rows(greedy.prefill_many(params, [head, PROMPTS[1]]), state, [0, 1], [2, 0], [0, 0])
    untouched = np.asarray(state.logits_bv[0])
    state, hidden = greedy.extend(params, state, {2: tail})
    whole = greedy.prefill(params, head + tail)
    np.testing.assert_allclose(np.asarray(state.logits_bv[2]), np.asarray(whole.logits_nv[0]), atol=1e-4)
    np.testing.assert_allclose(hidden[2], np.asarray(whole.hidden_nd[0]), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(state.logits_bv[0]), untouched)
    assert np.asarray(state.cache.lengths)[[0, 2]].tolist() == [len(PROMPTS[1]), len(head) + len(tail)]


def _expected_end(free_tokens, stop_sequences, eos_ids, limit):
    """Where a turn must end, by the rules: first stop sequence / EOS / limit, whichever comes first."""
    for n in range(1, limit + 1):
        if any(free_tokens[:n][-len(seq) :] == list(seq) for seq in stop_sequences if len(seq) <= n):
            return n, StopReason.STOP_SEQUENCE
        if free_tokens[n - 1] in eos_ids:
            return n, StopReason.EOS
    return limit, StopReason.TURN_LIMIT


def test_stop_sequence_eos_and_turn_limit_end_each_slot_on_its_own(checkpoint, greedy):
    _, _, params = checkpoint
    _, free_run = _run(greedy, params, PROMPTS[:3])
    free = [_turn(free_run, slot) for slot in range(3)]
    # A stop pair and an EOS id taken from the free-running greedy output, so the stop points are known.
    stop_sequences, eos_ids, limit = [[250, 251, 252], free[0][4:6]], [free[1][3]], 7
    stops = {"stop_sequences": stop_sequences, "eos_ids": eos_ids}
    _, out = _run(greedy, params, PROMPTS[:3], stops=stops, limit=limit)
    reasons = []
    for slot in range(3):
        n, reason = _expected_end(free[slot], stop_sequences, eos_ids, limit)
        assert _turn(out, slot) == free[slot][:n]
        assert out.stop_reason[slot] == reason
        reasons.append(reason)
    assert {StopReason.STOP_SEQUENCE, StopReason.EOS} <= set(reasons)
    assert out.stop_reason[3] == StopReason.IDLE and out.num_tokens[3] == 0


def test_a_turn_continues_across_calls_and_refill_after_returns_early(checkpoint, greedy):
    _, config, params = checkpoint
    short = _engine(config, steps_per_call=5, min_bucket=16)  # cache windows of 16, then 32 positions
    state = short.init_decode_state()
    state = short.insert_rows(short.prefill_many(params, PROMPTS[:2]), state, [0, 1], [0, 1], [0, 0], turn_limit=12)
    state, part1 = short.generate(params, state)
    assert part1.steps == 5 and (part1.stop_reason[:2] == StopReason.RUNNING).all()
    state, part2 = short.generate(params, state)
    assert short.compilations["generate"] == 2, "the second call should run on a wider cache window"
    _, whole = _run(short, params, [PROMPTS[0]], limit=5)
    assert _turn(part1, 0) == _turn(whole, 0)
    _, reference = _run(greedy, params, PROMPTS[:2])  # one call, the whole cache
    for slot in (0, 1):
        assert _turn(part1, slot) + _turn(part2, slot) == _turn(reference, slot)[:10]
    # refill_after=1: the call ends as soon as one slot's turn ends, the other keeps RUNNING.
    state = greedy.init_decode_state()
    prefix = greedy.prefill_many(params, PROMPTS[:2])
    state = greedy.insert_rows(prefix, state, [0], [0], [0], turn_limit=3)
    state = greedy.insert_rows(prefix, state, [1], [1], [0], turn_limit=12)
    _, early = greedy.generate(params, state, refill_after=1)
    assert early.steps == 3
    assert early.stop_reason[:2].tolist() == [StopReason.TURN_LIMIT, StopReason.RUNNING]


def test_slot_reuse_after_free_matches_a_fresh_engine(checkpoint, greedy):
    _, _, params = checkpoint
    state, _ = _run(greedy, params, [PROMPTS[2]], slots=[1])  # a long occupant leaves stale cache rows
    state = greedy.free_resource(state, 1)
    state = greedy.insert(greedy.prefill(params, PROMPTS[1]), state, 1)
    _, reused = greedy.generate(params, state)
    _, fresh = _run(greedy, params, [PROMPTS[1]])
    assert _turn(reused, 1) == _turn(fresh, 0)
    assert reused.stop_reason[0] == StopReason.IDLE


def test_context_full_stops_the_slot(checkpoint):
    _, config, params = checkpoint
    engine = _engine(config, max_len=16, min_bucket=16)
    _, out = _run(engine, params, [PROMPTS[2]])
    assert out.stop_reason[0] == StopReason.CONTEXT_FULL and out.num_tokens[0] == 16 - len(PROMPTS[2])
    with pytest.raises(ValueError, match="max_len"):
        engine.prefill(params, list(range(17)))


def test_bucketed_shapes_compile_a_fixed_set_of_programs(checkpoint):
    _, config, params = checkpoint
    engine = _engine(config, min_bucket=16)
    state = engine.init_decode_state()
    lengths = (3, 5, 9, 14)  # one prefill / extend bucket (16)
    for length in lengths:
        state = engine.insert(engine.prefill(params, list(range(1, length + 1))), state, 0)
        state, _ = engine.generate(params, state)
        state, _ = engine.extend(params, state, {0: [1] * length})
    # generate compiles once per cache window: the length bucket of (longest slot + steps_per_call).
    windows = {engine.config.length_bucket(n + engine.config.steps_per_call, "window") for n in lengths}
    assert len(windows) == 2
    assert engine.compilations == {"prefill": 1, "insert": 1, "generate": len(windows), "extend": 1}


def test_new_params_need_no_recompilation(checkpoint, greedy):
    _, config, params = checkpoint
    _, a = _run(greedy, params, PROMPTS[:1])
    before = dict(greedy.compilations)
    other = nnx.split(Qwen(config, rngs=nnx.Rngs(7)), nnx.Param)[1]
    _, b = _run(greedy, other, PROMPTS[:1])
    assert dict(greedy.compilations) == before
    assert _turn(a, 0) != _turn(b, 0)


def test_bad_inputs_name_the_setting_to_change(checkpoint, greedy):
    _, _, params = checkpoint
    state = greedy.init_decode_state()
    prefix = greedy.prefill(params, PROMPTS[1])
    with pytest.raises(ValueError, match=r"distinct and in \[0, 4\)"):
        greedy.bulk_insert(prefix, state, [1, 4])
    with pytest.raises(ValueError, match="max_stop_len"):
        greedy.init_decode_state(stop_sequences=[list(range(9))])
    with pytest.raises(ValueError, match="max_stop_sequences"):
        greedy.init_decode_state(stop_sequences=[[1]] * 5)
