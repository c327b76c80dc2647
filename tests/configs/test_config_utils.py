"""Config sections round-trip to the part dataclasses; typos are clear errors with near matches."""

import pytest

from trace_jax.config_utils import from_config, to_config
from trace_jax.rollout.engine.engine import EngineConfig
from trace_jax.rollout.engine.sampling import SamplingConfig


def test_round_trip_with_nested_dataclass_and_tuples():
    original = EngineConfig(max_slots=8, sampling=SamplingConfig(temperature=0.7, top_k=5))
    section = to_config(original)
    assert section.sampling.top_k == 5
    assert from_config(EngineConfig, section) == original


def test_overrides_win_and_partial_sections_keep_defaults():
    section = to_config(EngineConfig())
    section.sampling.temperature = 0.0
    built = from_config(EngineConfig, section, max_len=64)
    assert built.sampling.greedy and built.max_len == 64
    assert from_config(EngineConfig, {"max_slots": 3}) == EngineConfig(max_slots=3)


def test_tuple_fields_can_be_overridden_on_the_command_line():
    from trace_jax.job.commands import load_config

    flags = ["--config.engine.append_windows=(512,)", "--config.batch.length_buckets=(64, 512)"]
    config, _ = load_config(["train", *flags])
    assert config.engine.append_window_buckets == (512,)  # the typed run config: tuples stay tuples
    assert config.batch.length_buckets == (64, 512)


def test_unknown_field_names_the_class_and_near_matches():
    with pytest.raises(ValueError, match=r"EngineConfig has no field 'max_slot'; did you mean max_slots"):
        from_config(EngineConfig, {"max_slot": 3})
