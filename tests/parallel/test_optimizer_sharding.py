"""Optimizer state is born with its parameters' shardings and keeps them through a step and a restore."""

import json

import pytest

from tests.helpers import run_with_fake_devices


@pytest.fixture(scope="module")
def report():
    done = run_with_fake_devices("tests.parallel.optimizer_sharding_check", timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_adam_moments_take_their_parameters_sharding(report):
    assert report["up_proj_spec"] == "P(None, 'fsdp', 'tensor')"  # the premise: the (stacked) param is split
    assert report["up_proj_mu_spec"] == report["up_proj_spec"]
    assert report["after_init"] == []


def test_shardings_survive_a_step_and_a_restore(report):
    assert report["update_applied"] == 1.0 and report["moments_moved"]
    assert report["after_step"] == []
    assert report["after_restore"] == []


def test_no_device_holds_more_than_two_moments_of_its_params(report):
    assert report["ratio"] <= 2.1, report["ratio"]


def test_the_reference_policy_is_sharded_like_the_params(report):
    assert report["reference_like_params"]
