"""The engine's TPU decode attention: the Pallas paged-attention kernel in ``shard_map`` with shard-local pages,
run in Pallas TPU interpret mode on 4 fake CPU devices against the reference engine on one device."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import fake_cpu_devices
from trace_jax.models import ModelConfig
from trace_jax.rollout.engine import pages
from trace_jax.rollout.engine.engine import Engine, EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_kernel_engine_on_a_data_tensor_mesh_decodes_like_the_reference_engine():
    """Same greedy tokens and log-probs within 1e-4 (bf16 cache both ways; measured 3.6e-5) over forks across
    slot shards (~90 s: interpret mode on 4 fake devices).

    Mutants caught: tables not made shard-local (another shard's pages read), a fork across shards that shares
    instead of copying, the new token's keys written outside the shard, heads split over ``tensor`` in a
    different order from the pool's."""
    env = {**os.environ, "XLA_FLAGS": fake_cpu_devices(4), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.rollout.decode_kernel_check"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # Premises: the kernel engine really decodes through the kernel on 2 slot shards, forks crossed shards.
    assert result["decode_attention"] == "pallas_paged" and result["shard_map_in_hlo"]
    assert result["reference_attention"].startswith("reference")
    assert result["shards"] == 2 and result["cross_shard_copies"] > 0
    tables, per_shard = result["tables"], result["shard_pages"]
    assert all(page < per_shard for row in tables[:4] for page in row) and all(
        page == 0 or page >= per_shard for row in tables[4:] for page in row
    ), "slots 4..7 hold pages of shard 1 only"
    assert sum(len(t) for t in result["tokens"]) >= 40
    assert result["tokens"] == result["ref_tokens"]
    assert result["max_logprob_diff"] < 1e-4


def test_the_decode_kernel_follows_the_engine_devices_and_its_constraints():
    """On CPU devices the engine never takes the kernel; with interpret mode standing in for a TPU, head_dim
    64 (Qwen2.5-0.5B) takes it too (``paged_attention_narrow``), head_dim 32 falls back to the reference path
    with the reason, and an explicit ``attention="splash"`` refuses it naming the constraint. Mutant caught: the
    kernel chosen by the host backend or without checks."""
    config = EngineConfig(max_slots=4, max_len=32, page_size=8)
    head128 = ModelConfig(128, 64, 128, 1, 4, 2, 128)
    head64 = ModelConfig(128, 64, 128, 1, 4, 2, 64)
    head32 = ModelConfig(128, 64, 128, 1, 4, 2, 32)
    assert Engine.for_model(head128, config).decode_attention.startswith("reference: the engine's devices are cpu")
    pages.KERNEL_INTERPRET = True
    try:
        assert Engine.for_model(head128, config).decode_attention == "pallas_paged"
        assert Engine.for_model(head64, config).decode_attention == "pallas_paged"
        fallback = Engine.for_model(head32, config)
        assert fallback.decode_kernel is None and "head_dim=32" in fallback.decode_attention
        with pytest.raises(ValueError, match="head_dim=32"):
            Engine.for_model(dataclasses.replace(head32, attention="splash"), config)
        odd_pages = EngineConfig(max_slots=4, max_len=36, page_size=12)
        assert "page_size=12" in Engine.for_model(head128, odd_pages).decode_attention
    finally:
        pages.KERNEL_INTERPRET = False


def test_a_stopped_slot_past_its_table_does_not_overwrite_the_shards_last_page():
    """A stopped slot decodes at ``max_len`` (past its table) while a live slot owns the shard's last page: the
    stopped slot's write is dropped and that page keeps the live slot's keys and values (one shard, interpret
    mode). Mutant caught: the past-the-table page clamped to ``num_local_pages - 1`` instead of out of bounds."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    page_size, pages_per_slot, num_pages, head_dim = 8, 2, 4, 128
    max_len = page_size * pages_per_slot
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    kernel = pages.DecodeKernel(mesh, ("data",), None, pages_per_slot, interpret=True)
    rng = np.random.default_rng(0)
    pool = lambda: jnp.asarray(rng.standard_normal((1, 1, num_pages, page_size, head_dim)), jnp.float32)
    k_pages, v_pages = pool(), pool()
    last = num_pages - 1
    # Slot 0 (live) owns pages 2 and the shard's last page 3, decoding position 10 (page 3, offset 2); slot 1
    # (stopped) owns page 1 and decodes at max_len, past its table.
    table_bp = jnp.asarray([[2, last], [1, 0]], jnp.int32)
    positions_bt = jnp.asarray([[10], [max_len]], jnp.int32)
    cache = pages.PagedKVCache(
        k_pages, v_pages, table_bp, jnp.asarray([10, max_len], jnp.int32), jnp.arange(max_len), jnp.float32
    )
    new = lambda: jnp.asarray(rng.standard_normal((2, 1, 1, head_dim)), jnp.float32)
    q, k_new, v_new = jnp.asarray(rng.standard_normal((2, 1, 2, head_dim)), jnp.float32), new(), new()
    _, written = kernel.decode(cache, 0, q, k_new, v_new, positions_bt)
    # Premises: the stopped slot is past its table and lands at offset 0; the live slot's write landed.
    assert max_len // page_size == pages_per_slot and max_len % page_size == 0
    np.testing.assert_array_equal(written.k_pages[0, 0, last, 2], k_new[0, 0, 0])
    untouched = np.ones(page_size, bool)
    untouched[2] = False
    for before, after in ((k_pages, written.k_pages), (v_pages, written.v_pages)):
        np.testing.assert_array_equal(after[0, 0, last, untouched], before[0, 0, last, untouched])
        np.testing.assert_array_equal(after[0, 0, :last], before[0, 0, :last])
