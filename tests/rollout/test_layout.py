"""The sampling layout on 8 fake CPU devices: weights bf16, tensor-parallel and replicated over data / fsdp;
slots and KV pages split over data / fsdp, KV heads over tensor; same tokens as one device."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import fake_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def layout_run():
    env = dict(os.environ, XLA_FLAGS=fake_cpu_devices(8), JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-m", "tests.rollout.layout_check"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_weights_are_bf16_split_over_tensor_and_never_over_fsdp(layout_run):
    weights, train = layout_run["weights"], layout_run["train_specs"]
    assert any("fsdp" in spec for spec in train.values()), "premise: the trainer's weights are fsdp-sharded"
    for name, w in weights.items():
        assert "fsdp" not in w["spec"] and "data" not in w["spec"], name
        assert w["dtype"] == "bfloat16", name
    # q_proj [layers 2, embed 64, heads 4, head_dim 16]: heads over tensor=2, embed replicated.
    q = next(w for name, w in weights.items() if ".q_proj." in name)
    assert q["shape"] == [2, 64, 4, 16] and q["shard"] == [2, 64, 2, 16]
    up = next(w for name, w in weights.items() if ".up_proj." in name)
    assert up["shard"] == [2, 64, 64]  # mlp 128 over tensor
    embed = next(w for name, w in weights.items() if name.startswith("embed"))
    assert embed["shard"] == [64, 64]  # vocab 128 over tensor, hidden whole


def test_slots_and_pages_are_split_over_data_and_fsdp_and_heads_over_tensor(layout_run):
    cache = layout_run["cache"]
    pool = cache["k_pages"]  # [kv heads, layers, pages, page, head dim]
    assert pool["shard"] == [1, pool["shape"][1], pool["shape"][2] // 4, 8, 16]
    for name in ("lengths_b", "logits_bv", "hidden_bd", "stop_reason_b", "bank_logits_rv"):
        assert cache[name]["shard"][0] == cache[name]["shape"][0] // 4, name


def test_the_sharded_engine_decodes_like_one_device_and_new_weights_compile_nothing(layout_run):
    assert layout_run["same_tokens"]
    assert layout_run["max_logprob_diff"] < 1e-3  # bf16 weights both sides; reduction order differs
    assert layout_run["compiled_after_new_params"] == layout_run["compiled_first"]
