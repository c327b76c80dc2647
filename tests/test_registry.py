"""Registries: decorator registration, clear errors for unknown and duplicate names."""

import pytest

from trace_jax.registry import Registry
from trace_jax.rl.advantages import ESTIMATORS
from trace_jax.rl.losses import POLICY_LOSSES


def test_register_and_look_up():
    shapes = Registry("shape")

    @shapes.register("square")
    def square(x):
        return x * x

    assert shapes["square"](3) == 9 and "square" in shapes and "circle" not in shapes
    with pytest.raises(ValueError, match=r"unknown shape 'circle'; choose one of square"):
        shapes["circle"]
    with pytest.raises(ValueError, match="registered twice"):
        shapes.register("square")(square)


def test_framework_registries_name_their_choices():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; choose one of .*treerl"):
        ESTIMATORS["ppo"]
    with pytest.raises(ValueError, match=r"unknown policy loss 'sac'; choose one of .*gspo"):
        POLICY_LOSSES["sac"]
