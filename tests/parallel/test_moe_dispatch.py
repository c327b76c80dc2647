"""The all_to_all expert dispatch equals the gather dispatch and one device (logits and gradients) on fake-CPU
meshes with an expert axis (fsdp 2 x expert 4; fsdp 2 x expert 2 x tensor 2), with the router's own spread
routing and with every row sent to one shard."""

import json

import pytest

from tests.helpers import run_with_fake_devices
from trace_jax.models import ModelConfig

TOLERANCE = 1e-5  # float32, relative to the reference's largest logit / gradient entry


@pytest.fixture(scope="module")
def dispatch_run():
    done = run_with_fake_devices("tests.parallel.moe_dispatch_check", timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _all_to_all(run, routing):
    cases = {name: r for name, r in run.items() if name.startswith(f"{routing}/") and name.endswith("/all_to_all")}
    assert len(cases) == 2, sorted(run)
    return cases


def test_spread_routing_gives_the_same_logits_and_gradients(dispatch_run):
    """Premise: the router sends rows to more than one expert shard and the step holds all_to_all ops.
    Mutants checked (each moves the logits by 0.26-0.35 of their largest entry): the return all_to_all left
    out (a device reads back the rows it computed for others), the received rows grouped under the wrong
    local expert (``searchsorted`` side "left"), the outputs scattered back in sorted instead of token order
    (``position_m // k`` for ``order_m // k``)."""
    for name, result in _all_to_all(dispatch_run, "router").items():
        assert len(result["shards_receiving"]) > 1, name
        assert result["all_to_all_ops"] > 0, name
        assert dispatch_run[name.replace("all_to_all", "gather")]["all_to_all_ops"] == 0, name
        for key in ("logits_vs_gather", "grads_vs_gather", "logits_vs_one_device", "grads_vs_one_device"):
            assert result[key] <= TOLERANCE, (name, key, result[key])


def test_every_row_to_one_shard_drops_nothing(dispatch_run):
    """Routing replay puts every token on experts 0 and 1 (both on shard 0): all rows of every device go to
    one shard, the dropless worst case. Fails if a destination block holds fewer than local tokens x top-k
    rows (checked with half: rows spill into another block, logits off by 0.25), or if replay's selection is
    not the one dispatched (the recorded experts must be exactly the replayed ones)."""
    for name, result in _all_to_all(dispatch_run, "skewed").items():
        assert result["shards_receiving"] == [0] and result["experts_recorded"] == [0, 1], name
        for key in ("logits_vs_gather", "grads_vs_gather", "logits_vs_one_device", "grads_vs_one_device"):
            assert result[key] <= TOLERANCE, (name, key, result[key])


def test_dispatch_is_a_config_choice_outside_the_hf_config():
    """Fails if ``expert_dispatch`` leaks into transformers' config.json, loses its default, or accepts a name
    with no dispatch behind it."""
    config = ModelConfig.preset("qwen3-moe-tiny", expert_dispatch="all_to_all")
    assert ModelConfig.preset("qwen3-moe-tiny").expert_dispatch == "gather"
    assert "expert_dispatch" not in config.to_hf()
    assert ModelConfig.from_hf(config.to_hf()).expert_dispatch == "gather"
    with pytest.raises(ValueError, match="expert_dispatch"):
        ModelConfig.preset("qwen3-moe-tiny", expert_dispatch="ragged")
