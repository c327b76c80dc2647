"""The decode engine on a tiny Qwen3: exactness against transformers, forks, extend, stops, slot reuse and the
fixed program set."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from tests.helpers import build_hf_checkpoint
from trace_jax.checkpoint.hf import load_hf
from trace_jax.models import Qwen, abstract_model
from trace_jax.rollout.engine.engine import AppendItem, Engine, EngineConfig, StopReason
from trace_jax.rollout.engine.sampling import SamplingConfig

GREEDY = SamplingConfig.make_greedy()
PROMPTS = [[5, 17, 3, 99, 42, 8, 1], [64, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [7, 7, 7, 30]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    reference = build_hf_checkpoint(path, "qwen3", vocab_size=128)
    config, params = load_hf(path)
    return reference, config, params


def _engine(config, params, **fields) -> Engine:
    # One length bucket and one row bucket: one program per entry point (buckets get their own test below).
    base = dict(
        max_slots=4, max_len=64, steps_per_call=12, max_turn_tokens=12, length_buckets=(64,), row_buckets=(4,),
        sampling=GREEDY, weight_dtype=None,
    )  # fmt: skip
    engine = Engine(abstract_model(config)[0], config, EngineConfig(**{**base, **fields}))
    engine.set_params(params)
    return engine


@pytest.fixture(scope="module")
def greedy(checkpoint):
    return _engine(checkpoint[1], checkpoint[2])


def _run(engine, prompts, seeds=None, slots=None, stops=None, limit=None, **generate_kw):
    """Inserts ``prompts`` into ``slots`` in one call and generates once."""
    state = engine.init_decode_state(**(stops or {}))
    slots = list(range(len(prompts))) if slots is None else slots
    seeds = [0] * len(prompts) if seeds is None else seeds
    state, _ = engine.insert(None, state, prompts, slots, seeds, turn_limit=limit)
    return engine.generate(None, state, **generate_kw)


def _turn(out, slot):
    return out.tokens[slot, : out.num_tokens[slot]].tolist()


def test_greedy_equals_transformers_generate_for_prompts_of_different_lengths(checkpoint, greedy):
    reference = checkpoint[0]
    state, out = _run(greedy, PROMPTS)
    for slot, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ids = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert _turn(out, slot) == ids[0, len(prompt) :].tolist()
        assert out.stop_reason[slot] == StopReason.TURN_LIMIT
        np.testing.assert_allclose(out.sample_logprobs[slot, :12], 0.0)
        assert (out.logprobs[slot, :12] < 0).all()
    assert state.lengths.tolist() == [len(p) + 12 for p in PROMPTS]  # host bookkeeping, no device read


def test_fork_equals_independent_runs_and_computes_the_prefix_once(checkpoint):
    _, config, params = checkpoint
    engine = _engine(config, params, sampling=SamplingConfig(temperature=1.0))
    prompt, seeds = PROMPTS[0], [3, 4, 5]
    state = engine.init_decode_state()
    state, result = engine.insert(None, state, [prompt], [0], [9], keep=True)
    state = engine.free_resource(state, [0])  # the kept prefix outlives its slot
    state = engine.bulk_insert(state, result.prefixes[0], [1, 2, 3], seeds)
    assert engine.counters["append_tokens"] == len(prompt)
    _, forked = engine.generate(None, state)
    turns = {tuple(_turn(forked, s)) for s in (1, 2, 3)}
    assert len(turns) > 1, "different seeds should give different continuations"
    for slot, seed in zip([1, 2, 3], seeds, strict=True):
        _, alone = _run(engine, [prompt], seeds=[seed], slots=[0])
        assert _turn(alone, 0) == _turn(forked, slot)
        np.testing.assert_allclose(alone.logprobs[0], forked.logprobs[slot], atol=1e-5)
        np.testing.assert_allclose(alone.hidden[0], forked.hidden[slot], atol=1e-5)


def test_insert_then_extend_equals_insert_of_the_concatenation(greedy):
    head, tail = PROMPTS[0], [40, 41, 42, 43, 44]
    state = greedy.init_decode_state()
    state, _ = greedy.insert(None, state, [head, PROMPTS[1]], [2, 0], [0, 0])
    untouched = np.asarray(state.device.logits_bv[0])
    state, result = greedy.extend(None, state, {2: tail})
    other = greedy.init_decode_state()
    other, whole = greedy.insert(None, other, [head + tail], [1], [0])
    np.testing.assert_allclose(np.asarray(state.device.logits_bv[2]), np.asarray(other.device.logits_bv[1]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(result.hidden[0]), np.asarray(whole.hidden[0]), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(state.device.logits_bv[0]), untouched)
    assert np.asarray(state.device.lengths_b)[[0, 2]].tolist() == [len(PROMPTS[1]), len(head) + len(tail)]
    assert state.lengths[[0, 2]].tolist() == [len(PROMPTS[1]), len(head) + len(tail)]


def _expected_end(free_tokens, stop_sequences, eos_ids, limit):
    """Where a turn must end, by the rules: first stop sequence / EOS / limit, whichever comes first."""
    for n in range(1, limit + 1):
        if any(free_tokens[:n][-len(seq) :] == list(seq) for seq in stop_sequences if len(seq) <= n):
            return n, StopReason.STOP_SEQUENCE
        if free_tokens[n - 1] in eos_ids:
            return n, StopReason.EOS
    return limit, StopReason.TURN_LIMIT


def test_stop_sequence_eos_and_turn_limit_end_each_slot_on_its_own(greedy):
    _, free_run = _run(greedy, PROMPTS[:3])
    free = [_turn(free_run, slot) for slot in range(3)]
    # A stop pair and an EOS id taken from the free-running greedy output, so the stop points are known.
    stop_sequences, eos_ids, limit = [[250, 251, 252], free[0][4:6]], [free[1][3]], 7
    stops = {"stop_sequences": stop_sequences, "eos_ids": eos_ids}
    _, out = _run(greedy, PROMPTS[:3], stops=stops, limit=limit)
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
    short = _engine(config, params, steps_per_call=5, length_buckets=(16, 64))  # windows of 16, then 64
    state = short.init_decode_state()
    state, _ = short.insert(None, state, PROMPTS[:2], [0, 1], [0, 0], turn_limit=12)
    state, part1 = short.generate(None, state)
    assert part1.steps == 5 and (part1.stop_reason[:2] == StopReason.RUNNING).all()
    state, part2 = short.generate(None, state)
    assert short.compilations["generate"] == 2, "the second call should run on a wider cache window"
    _, reference = _run(greedy, PROMPTS[:2])  # one call
    for slot in (0, 1):
        assert _turn(part1, slot) + _turn(part2, slot) == _turn(reference, slot)[:10]
    # refill_after=1: the call ends as soon as one slot's turn ends, the other keeps RUNNING.
    state = greedy.init_decode_state()
    state, _ = greedy.insert(None, state, PROMPTS[:1], [0], [0], turn_limit=3)
    state, _ = greedy.insert(None, state, PROMPTS[1:2], [1], [0], turn_limit=12)
    _, early = greedy.generate(None, state, refill_after=1)
    assert early.steps == 3
    assert early.stop_reason[:2].tolist() == [StopReason.TURN_LIMIT, StopReason.RUNNING]


def test_slot_reuse_after_free_matches_a_fresh_engine(greedy):
    state, _ = _run(greedy, [PROMPTS[2]], slots=[1])  # a long occupant leaves stale pages behind
    state = greedy.free_resource(state, [1])
    assert state.pool.in_use == 0
    state, _ = greedy.insert(None, state, [PROMPTS[1]], [1], [0])
    _, reused = greedy.generate(None, state)
    _, fresh = _run(greedy, [PROMPTS[1]])
    assert _turn(reused, 1) == _turn(fresh, 0)
    assert reused.stop_reason[0] == StopReason.IDLE


def test_a_freed_slot_whose_turn_never_ended_is_not_decoded(greedy):
    state = greedy.init_decode_state()
    state, _ = greedy.insert(None, state, PROMPTS[:2], [0, 1], [0, 0])
    state = greedy.free_resource(state, [0])
    state, out = greedy.generate(None, state)
    assert out.num_tokens[0] == 0 and out.stop_reason[0] == StopReason.IDLE and out.num_tokens[1] == 12


def test_context_full_stops_the_slot(checkpoint):
    _, config, params = checkpoint
    engine = _engine(config, params, max_len=16, length_buckets=(16,))
    _, out = _run(engine, [PROMPTS[2]])
    assert out.stop_reason[0] == StopReason.CONTEXT_FULL and out.num_tokens[0] == 16 - len(PROMPTS[2])
    with pytest.raises(ValueError, match="max_len"):
        engine.insert(None, engine.init_decode_state(), [list(range(17))], [0], [0])


def test_the_program_set_is_compiled_ahead_and_a_late_compile_is_a_warning(checkpoint, caplog):
    _, config, params = checkpoint
    engine = _engine(
        config, params, max_len=32, steps_per_call=4, length_buckets=(8, 32), row_buckets=(2, 4), append_chunk=8,
        append_row_buckets=(4, 16), append_windows=(8, 16),
    )  # fmt: skip
    state = engine.init_decode_state()
    compiled = engine.warmup(None, state)
    # append: 8-id chunks in 4 or 16 rows reading 8 (4 rows at most), 16 or 32 positions; fork: 2 row buckets;
    # generate: windows 8 and 32.
    assert engine.config.append_shapes == ((4, 8), (4, 16), (16, 16), (4, 32), (16, 32))
    assert compiled == 5 + 2 + 2 and engine.programs.warm
    total = engine.programs.total  # the warm-up's programs plus init's
    rng = np.random.default_rng(0)
    for length in (3, 5, 9, 14, 20):  # every shape lands in a bucket
        prompts = [rng.integers(1, 100, length).tolist() for _ in range(1 + length % 3)]
        state, result = engine.insert(None, state, prompts, list(range(len(prompts))), [0] * len(prompts), keep=True)
        state, _ = engine.generate(None, state, refill_after=1)
        state = engine.free_resource(state, range(len(prompts)))
        state = engine.fork(state, result.prefixes[:1], [3], [1])
        for prefix in result.prefixes:
            state = engine.drop_prefix(state, prefix)
        state, _ = engine.generate(None, state)
        state = engine.free_resource(state, [3])
    assert engine.programs.total == total and not engine.programs.late
    assert state.pool.in_use == 0, "every page came back"
    # Weights of another dtype are another signature: compiled, counted and warned about.
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with caplog.at_level(logging.WARNING, logger="trace_jax.rollout.engine.programs"):
        engine.generate(bf16, state)
    assert [name for name, _ in engine.programs.late] == ["generate"]
    assert "generate" in caplog.text and "after warm-up" in caplog.text


def test_new_params_need_no_recompilation(checkpoint, greedy):
    _, config, _ = checkpoint
    _, a = _run(greedy, PROMPTS[:1])
    before = dict(greedy.compilations)
    greedy.set_params(nnx.split(Qwen(config, rngs=nnx.Rngs(7)), nnx.Param)[1])
    _, b = _run(greedy, PROMPTS[:1])
    greedy.set_params(checkpoint[2])
    assert dict(greedy.compilations) == before
    assert _turn(a, 0) != _turn(b, 0)


def test_greedy_is_a_per_slot_flag_of_a_sampling_engine(checkpoint, greedy):
    _, config, params = checkpoint
    sampler = _engine(config, params, sampling=SamplingConfig(temperature=1.0))
    state = sampler.init_decode_state()
    state, _ = sampler.append(None, state, [AppendItem(0, PROMPTS[0], True, 3, greedy=True)])
    state, _ = sampler.append(None, state, [AppendItem(1, PROMPTS[0], True, 3, greedy=False)])
    _, out = sampler.generate(None, state)
    _, argmax = _run(greedy, PROMPTS[:1])
    assert _turn(out, 0) == _turn(argmax, 0) != _turn(out, 1)
    np.testing.assert_allclose(out.sample_logprobs[0], 0.0)


def test_a_greedy_sequence_stays_greedy_after_an_observation_whatever_its_seed(checkpoint):
    # An evaluation's later turns follow appended observations; its seeds differ between a run and its resume.
    _, config, params = checkpoint
    sampler = _engine(config, params, sampling=SamplingConfig(temperature=1.0))
    state = sampler.init_decode_state()
    items = [AppendItem(slot, PROMPTS[0], True, seed, greedy=True) for slot, seed in ((0, 1), (1, 2))]
    state, _ = sampler.append(None, state, items)
    state, _ = sampler.generate(None, state)
    state, _ = sampler.extend(None, state, {0: PROMPTS[1], 1: PROMPTS[1]})
    _, out = sampler.generate(None, state)
    assert out.num_tokens[0] > 0 and _turn(out, 0) == _turn(out, 1)
    np.testing.assert_allclose(out.sample_logprobs[:2], 0.0)


def test_bad_inputs_name_the_setting_to_change(greedy):
    state = greedy.init_decode_state()
    with pytest.raises(ValueError, match=r"distinct and in \[0, 4\)"):
        greedy.insert(None, state, [PROMPTS[1]] * 2, [1, 4], [0, 0])
    with pytest.raises(ValueError, match="max_stop_len"):
        greedy.init_decode_state(stop_sequences=[list(range(9))])
    with pytest.raises(ValueError, match="max_stop_sequences"):
        greedy.init_decode_state(stop_sequences=[[1]] * 5)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(max_len=64, page_size=24)


def test_a_chunked_append_equals_one_row_per_item(checkpoint):
    """Prompts, an observation and a start from a held prefix cut into 4-id chunks (several per item, all in one
    call) sample the same tokens with the same log-probs as one whole row per item."""
    _, config, params = checkpoint
    sampling = SamplingConfig(temperature=1.0)
    whole = _engine(config, params, append_chunk=64, sampling=sampling)
    chunked = _engine(config, params, append_chunk=4, sampling=sampling)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 128, n).tolist() for n in (23, 2, 9, 17)]
    observation = rng.integers(1, 128, 14).tolist()
    runs = []
    for engine in (whole, chunked):
        state = engine.init_decode_state()
        items = [AppendItem(slot, p, True, seed=slot, hold=slot == 0) for slot, p in enumerate(prompts)]
        state, first = engine.append(None, state, items)
        state, turn1 = engine.generate(None, state)
        state, extended = engine.extend(None, state, {1: observation, 3: observation[:5]})
        state = engine.free_resource(state, [2])
        # Slot 2 starts from slot 0's held prompt: only the 15 ids past it (and its last) are computed.
        item = AppendItem(2, prompts[0] + observation, True, seed=7, start=first.held[0])
        state, started = engine.append(None, state, [item])
        state, turn2 = engine.generate(None, state)
        hidden = [np.asarray(r.hidden) for r in (first, extended, started)]
        runs.append((hidden, turn1, turn2, engine.counters["append_padded_tokens"]))
    assert runs[1][3] < runs[0][3], "premise: the chunked engine ran fewer padded positions"
    assert chunked.config.append_width == 4 < len(prompts[0]) // 4, "premise: items span several chunks"
    for hidden_whole, hidden_chunked in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_allclose(hidden_chunked, hidden_whole, atol=1e-5)
    for a, b in ((runs[0][1], runs[1][1]), (runs[0][2], runs[1][2])):
        assert a.num_tokens.sum() > 0 and a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
        np.testing.assert_allclose(b.sample_logprobs, a.sample_logprobs, atol=1e-5)


def test_append_padding_follows_the_ids_not_the_longest_item(checkpoint):
    """A runner-like mix (short observations, now and then a long history) runs at most 2x its chunks' positions
    per call (rows padded to a power of two) and under 2x the ids overall (1.7x); one row per item at the longest
    item's width would run 3.5x."""
    _, config, params = checkpoint
    chunk = 16
    engine = _engine(config, params, max_slots=8, max_len=128, append_chunk=chunk, length_buckets=(128,))
    state = engine.init_decode_state()
    rng = np.random.default_rng(0)
    one_row_per_item = 0
    for _ in range(6):
        lengths = [*rng.integers(3, 24, 5), rng.integers(60, 120)]
        items = [AppendItem(slot, rng.integers(1, 128, n), True) for slot, n in enumerate(lengths)]
        before = engine.counters["append_padded_tokens"]
        state, _ = engine.append(None, state, items)
        chunks = sum(-(-n // chunk) for n in lengths)
        assert engine.counters["append_padded_tokens"] - before <= 2 * chunks * chunk
        one_row_per_item += len(items) * max(lengths)
        state = engine.free_resource(state, range(len(items)))
    ids, padded = engine.counters["append_tokens"], engine.counters["append_padded_tokens"]
    assert one_row_per_item > 3 * ids, "premise: the mix pads badly as one row per item"
    assert padded <= 2 * ids, f"{padded} positions for {ids} ids"
