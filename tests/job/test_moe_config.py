"""Config checks of a mixture-of-experts run: routing replay needs a router; the qwen3-30b-a3b recipe loads."""

import pathlib

import pytest

from trace_jax.configs import load_config_file, validate
from trace_jax.job.cli import ConfigError
from trace_jax.models import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_routing_replay_is_refused_for_a_dense_policy_and_allowed_for_a_mixture_of_experts():
    """Fails if a dense run with routing replay gets past the config check (it would fail in the engine)."""
    config = load_config_file(str(ROOT / "configs" / "default.py"))
    assert PRESETS[config.sft.model].routing_shape is None  # premise: the default policy is dense
    assert validate.problems(config) == []
    config.engine.routing_replay = True
    with pytest.raises(ConfigError, match=r"engine\.routing_replay=True .* is dense"):
        validate.validate(config)
    config.sft.model = "qwen3-moe-tiny"
    assert validate.problems(config) == []


def test_the_qwen3_30b_a3b_recipe_loads_with_experts_split_and_routing_replayed():
    """The variant validates as a config, splits its 128 experts over mesh.expert and fits a v5p-64's 32 chips."""
    config = load_config_file(str(ROOT / "configs" / "search_r1.py:qwen3-30b-a3b"))
    assert validate.problems(config) == []
    assert config.recipe.kind == "search_r1" and config.engine.routing_replay
    assert config.mesh.expert == 8 and PRESETS["qwen3-30b-a3b"].num_experts % config.mesh.expert == 0
    validate.check_mesh(validate.validate(config), 32)  # fsdp -1 takes the remaining 4 ways
    dense = load_config_file(str(ROOT / "configs" / "search_r1.py:qwen3-8b"))
    assert not dense.engine.routing_replay and dense.mesh.expert == 1
