"""The mock engine's outputs follow by hand from its policy; the toy env's rules."""

import numpy as np

from trace_jax.rollout.engine.engine import EngineConfig, StopReason
from trace_jax.rollout.engine.mock import (
    BAD,
    GOOD,
    OBS,
    STOP_A,
    STOP_B,
    MockEngine,
    ToyEnv,
    mock_hidden,
    sum_policy,
    toy_policy,
)


def test_mock_generate_is_hand_computable_and_stops_like_the_engine():
    engine = MockEngine(EngineConfig(max_slots=3, max_len=64, steps_per_call=10, max_turn_tokens=6))
    state = engine.init_decode_state(stop_sequences=[[9, 9]], eos_ids=[0])
    state, _ = engine.insert(None, state, [[1, 2], [30]], [0, 2], [5, 2])
    state, out = engine.generate(None, state)
    # slot 0: history [1, 2], seed 5 -> tokens (sum + 5) % 32: 8, 16, 0 (EOS)
    assert out.tokens[0, : out.num_tokens[0]].tolist() == [8, 16, 0]
    assert out.stop_reason[0] == StopReason.EOS
    # slot 2: history [30], seed 2 -> 0 (EOS) at once
    assert out.tokens[2, : out.num_tokens[2]].tolist() == [0] and out.stop_reason[2] == StopReason.EOS
    assert out.stop_reason[1] == StopReason.IDLE
    np.testing.assert_array_equal(out.hidden[0], mock_hidden([1, 2, 8, 16, 0]))
    assert sum_policy(np.asarray([1, 2]), [], 5) == 8


def test_toy_policy_and_env_give_seed_bit_rewards():
    env = ToyEnv(max_turns=2)
    assert toy_policy(np.asarray([7]), [], seed=1) == GOOD and toy_policy(np.asarray([7, OBS]), [], seed=1) == BAD
    assert toy_policy(np.asarray([7]), [GOOD], seed=0) == STOP_A
    first = env.step(0, 1, np.asarray([GOOD, STOP_A, STOP_B]))
    assert not first.done and first.observation_ids.tolist() == [OBS, 8]
    assert env.step(0, 2, np.asarray([GOOD, STOP_A, STOP_B])).reward == 1.0
    assert env.step(0, 2, np.asarray([BAD, STOP_A, STOP_B])).reward == 0.0
    assert env.step(0, 1, np.asarray([GOOD]), truncated=True).done
    assert not ToyEnv(truncation_ends=False).step(0, 1, np.asarray([GOOD]), truncated=True).done
