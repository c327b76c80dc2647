"""TPU kernels on a CPU host: numerics in Pallas TPU interpret mode against the reference attention (and the
grouped matmul's TPU branch against ragged_dot), and AOT compiles for a v5p:2x2x1 (4 abstract chips, libtpu)
that must contain the Mosaic kernels, chosen by the devices the program is compiled for, never by this host's
backend."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.tpu_topology import MOSAIC, tpu_devices
from trace_jax.kernels import megablox, tree_attention
from trace_jax.kernels.tree_attention import tree_flash_attention
from trace_jax.models import ModelConfig, abstract_model, moe
from trace_jax.models import attention as attention_lib
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.plan import hlo
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout


def _tree_ends(rng, b, t):
    """kv_end of rows of random trees in pre-order (nested intervals [s, end)), several trees a row."""
    ends = np.zeros((b, t), np.int32)
    for row in range(b):
        stack: list[int] = []
        for s in range(t):
            while stack and rng.random() < 0.3:
                ends[row, stack.pop()] = s
            if s % 96 == 0:  # a new tree: close every open node
                while stack:
                    ends[row, stack.pop()] = s
            stack.append(s)
        for node in stack:
            ends[row, node] = t
    return jnp.asarray(ends)


def _segment_ends(b, t, length=80):
    """kv_end of packed causal segments (several sequences a row): each key seen to its segment's end."""
    index = np.arange(t)
    return jnp.asarray(np.broadcast_to(np.minimum((index // length + 1) * length, t), (b, t)).astype(np.int32))


def _qkv(rng, b, t, h, kv, e):
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return draw(b, t, h, e), draw(b, t, kv, e), draw(b, t, kv, e)


@pytest.mark.parametrize("mask", ["tree", "segments"])
def test_the_tree_kernel_matches_the_reference_forward_and_backward(mask):
    """Interpret mode, float32, GQA (2 query heads per KV head), 2 x 384 rows (3 x 3 tiles, some of them masked
    whole and skipped): outputs and the three gradients match the reference to 1e-5 (measured ~3e-6: the same
    float32 math in another order).

    Mutants caught: the tile mask off by one (``k < q`` or ``q <= kv_end``), ``kv_end`` ignored (plain causal),
    a tile skipped that holds visible keys (causal or ``kv_end`` test), dk / dv not summed over the query heads
    of a KV head."""
    rng = np.random.default_rng(0)
    t = 384
    q, k, v = _qkv(rng, 2, t, 4, 2, 128)
    ends = _tree_ends(rng, 2, t) if mask == "tree" else _segment_ends(2, t)
    assert (np.asarray(ends) < t).any(), "premise: the mask hides keys that causality alone would show"
    tile_ends = np.asarray(ends).reshape(2, 3, 128).max(-1)
    assert (tile_ends[:, 0] <= 256).any(), "premise: tile (query 2, key 0) is masked whole somewhere (skipped)"
    index = jnp.broadcast_to(jnp.arange(t), (2, t))
    reference = lambda q, k, v: attention_lib.reference_attention(q, k, v, index, ends, True)
    kernel = lambda q, k, v: tree_flash_attention(q, k, v, ends, interpret=True)
    np.testing.assert_allclose(kernel(q, k, v), reference(q, k, v), atol=1e-5)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    grads = lambda fn: jax.grad(lambda *x: (fn(*x) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads(kernel), grads(reference), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


TABLE_BLOCKS = sorted(set(tree_attention.BLOCK_TABLE.values()), key=lambda b: (b.resident, b.streamed))


@pytest.mark.parametrize("blocks", TABLE_BLOCKS, ids=lambda b: f"{b.resident}x{b.streamed}")
def test_each_tuning_table_tile_matches_the_reference_forward_and_backward(blocks):
    """Interpret mode, float32, one row of 1,024 tree-packed tokens, one head, through each tile of the tuning
    table: outputs and gradients equal the reference to 1e-5; where the rows hold more than one resident block,
    with tiles skipped after live ones (the fetch table's re-used blocks). Mutants caught: a wrong clamp in the
    fetch table (a skipped tile's block that no earlier step holds, or a live tile fetching another block), a
    tile's mask built at the default block size."""
    rng = np.random.default_rng(1)
    t = 1024
    q, k, v = _qkv(rng, 1, t, 1, 1, 128)
    ends = _tree_ends(rng, 1, t)
    if blocks.resident < t:
        table = np.asarray(tree_attention.fetch_table(ends, t, blocks.resident, blocks.streamed, False))
        live = table == np.arange(table.shape[2])
        assert (~live & (np.arange(table.shape[2]) > live.argmax(axis=2)[..., None])).any(), "premise: re-used"
    index = jnp.broadcast_to(jnp.arange(t), (1, t))
    reference = lambda q, k, v: attention_lib.reference_attention(q, k, v, index, ends, True)
    kernel = lambda q, k, v: tree_flash_attention(q, k, v, ends, interpret=True, blocks=blocks)
    np.testing.assert_allclose(kernel(q, k, v), reference(q, k, v), atol=1e-5)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    grads = lambda fn: jax.grad(lambda *x: (fn(*x) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads(kernel), grads(reference), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_head_dim_64_runs_padded_to_whole_lanes_and_matches_the_reference():
    """Qwen2.5-0.5B's head_dim 64 through the tree kernel (interpret mode, float32, one head): zero-padded to 128
    lanes, output sliced, the softmax scale of the true head_dim; outputs and gradients equal the reference to
    1e-5. Mutant caught: the scale taken from the padded head_dim (1/sqrt(128))."""
    rng = np.random.default_rng(3)
    t = 256
    q, k, v = _qkv(rng, 1, t, 1, 1, 64)
    ends = _tree_ends(rng, 1, t)
    index = jnp.broadcast_to(jnp.arange(t), (1, t))
    reference = lambda q, k, v: attention_lib.reference_attention(q, k, v, index, ends, True)
    kernel = lambda q, k, v: tree_flash_attention(q, k, v, ends, interpret=True)
    assert kernel(q, k, v).shape == q.shape
    np.testing.assert_allclose(kernel(q, k, v), reference(q, k, v), atol=1e-5)
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    grads = lambda fn: jax.grad(lambda *x: (fn(*x) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(grads(kernel), grads(reference), strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-5)


def _visible_tiles(ends, t, block_q, block_k, keys_outer):
    """bool [B, outer, inner]: tiles holding a pair ``s <= t < kv_end[s]``, by brute force."""
    ends = np.asarray(ends)
    rows, keys = np.arange(t)[:, None], np.arange(ends.shape[1])[None, :]
    pairs = (keys <= rows)[None] & (rows[None] < ends[:, None, :])  # [B, T, S]
    b = ends.shape[0]
    tiles = pairs.reshape(b, t // block_q, block_q, -1, block_k).any(axis=(2, 4))
    return tiles.transpose(0, 2, 1) if keys_outer else tiles


def test_the_fetch_table_fetches_nothing_for_skipped_tiles():
    """Along each reduction a new block is fetched only at a tile that holds a visible pair (or at the first
    step): a tile the mask skips, causally or by the tree, names the block already resident. Mutant caught:
    skipped tiles found by causality only (tree-masked tiles fetched)."""
    rng = np.random.default_rng(2)
    t = 1024
    ends = _tree_ends(rng, 2, t)
    for block_q, block_k, keys_outer in ((512, 128, False), (128, 512, True), (128, 128, False)):
        table = np.asarray(tree_attention.fetch_table(ends, t, block_q, block_k, keys_outer))
        visible, causal = [_visible_tiles(x, t, block_q, block_k, keys_outer) for x in (ends, np.full(ends.shape, t))]
        steps = np.arange(table.shape[2])
        assert (causal & ~visible).any(), "premise: the tree hides tiles causality would show"
        fetched = np.concatenate([np.ones_like(table[..., :1], bool), table[..., 1:] != table[..., :-1]], axis=2)
        assert not (fetched & ~visible & (steps > 0)).any()
        assert ((table == steps) >= visible).all()  # every visible tile is computed
    blocks = tree_attention.Blocks(512, 128)
    assert (
        tree_attention.cost("forward", 1, 1, 4096, 4096, 128, 2, blocks).bytes_accessed
        < tree_attention.cost("forward", 1, 1, 4096, 4096, 128, 2).bytes_accessed
    )


def test_the_tuning_table_fits_its_tile_to_the_rows_and_refuses_a_tile_that_does_not():
    """The table's tile for a chip, halved until it divides the rows; the default elsewhere; a tile that is not
    a multiple of 128 dividing the rows is refused naming it."""
    choose = tree_attention.choose_blocks
    assert choose("v6e", 128, 4096, 4096) == tree_attention.Blocks(1024, 128)
    assert choose("v6e", 128, 1536, 1536) == tree_attention.Blocks(512, 128)
    assert choose("v5p", 128, 384, 384) == choose(None, 128, 4096, 4096) == tree_attention.DEFAULT_BLOCKS
    q = jnp.zeros((1, 384, 1, 128), jnp.float32)
    ends = jnp.full((1, 384), 384, jnp.int32)
    for bad in (tree_attention.Blocks(256, 128), tree_attention.Blocks(128, 192)):
        with pytest.raises(ValueError, match="Blocks"):
            tree_flash_attention(q, q, q, ends, interpret=True, blocks=bad)


def test_training_kernels_in_interpret_mode_equal_the_reference(monkeypatch):
    """``implementation="splash"`` with no mesh, run by the Pallas interpreter on CPU (the closest check possible
    without a TPU): causal rows by splash, tree rows by the tree kernel (a tree mask is data: it computes it per
    tile), both equal to the reference."""
    monkeypatch.setattr(attention_lib, "SPLASH_INTERPRET", True)
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng, 1, 128, 2, 1, 128)
    index = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (1, 128))
    for kv_end, atol in ((None, 1e-4), (_tree_ends(rng, 1, 128), 1e-5)):
        want = attention_lib.attention(q, k, v, index, kv_end, in_order=True, implementation="reference")
        got = attention_lib.attention(q, k, v, index, kv_end, in_order=True, implementation="splash")
        np.testing.assert_allclose(got, want, atol=atol)


def test_training_kernels_under_a_mesh_run_in_shard_map_and_match_the_reference(monkeypatch):
    """``implementation="splash"`` traced under a (one-device) mesh goes through the ``shard_map`` wrapper: causal
    rows by splash, tree rows by the tree kernel, both equal to the reference. Mutant caught: the wrapper's
    specs dropping the rows or heads (shapes) or passing kv_end unsplit."""
    monkeypatch.setattr(attention_lib, "SPLASH_INTERPRET", True)
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 128, 2, 1, 128)
    ends = _tree_ends(rng, 1, 128)
    index = jnp.broadcast_to(jnp.arange(128), (1, 128))
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    for kv_end in (None, ends):
        fn = lambda q, k, v, kv_end=kv_end: attention_lib.attention(
            q, k, v, index, kv_end, in_order=True, implementation="splash"
        )
        traced = mesh_lib.traced_under(mesh, fn)
        assert "shard_map" in str(jax.make_jaxpr(traced)(q, k, v))
        want = attention_lib.reference_attention(q, k, v, index, kv_end, True)
        np.testing.assert_allclose(jax.jit(traced)(q, k, v), want, atol=1e-4)


# ----------------------------------------------------------------------------------- AOT for v5p:2x2x1
# head_dim 128 (the kernels' block rule), 2 layers, small otherwise; rows of 384 tokens (3 tiles), a length no
# weight has, so a [.., q, 384] float32 array in the HLO can only be attention scores.
TPU_QWEN = ModelConfig(256, 128, 256, 2, 4, 2, 128, dtype="bfloat16", param_dtype="float32")
ROWS, SEQ = 8, 384
SCORES = re.compile(r"f32\[[\d,]*?(\d+),384\]")


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _train_grad_compiled(mesh, tree: bool):
    graphdef, params = abstract_model(TPU_QWEN)
    params = _abstract(params, mesh_lib.state_shardings(params, mesh))
    rows = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))

    def loss(p, tokens, ends):
        hidden, _ = nnx.merge(graphdef, p).hidden(tokens, kv_visible_end_bt=ends if tree else None)
        return hidden.astype(jnp.float32).sum()

    return jax.jit(mesh_lib.traced_under(mesh, jax.grad(loss))).lower(params, rows, rows).compile()


@pytest.mark.parametrize("tree", [True, False], ids=["packed_and_tree_rows", "causal_rows"])
def test_tpu_training_forward_backward_on_fsdp_runs_the_kernels(tree):
    """Forward + backward of the 2-layer Qwen3 on ``fsdp``=4, compiled by the TPU compiler from this CPU host.
    Packed rows (segments) and tree-packed rows are one program (their mask is data: ``kv_visible_end``);
    causal rows (no kv_end) take splash. Each: 3 Mosaic calls (forward, dq, dk/dv), no float32 [.., q, 384]
    score block anywhere, temporaries under 96 MiB (measured ~40-55 MiB).

    Mutants caught: the kernel chosen by ``jax.default_backend()`` (cpu here: no Mosaic call, score blocks in
    the HLO), the reference kept under a mesh, a backward that falls back to XLA (fewer than 3 calls)."""
    mesh = mesh_lib.make_mesh(data=1, fsdp=4, tensor=1, devices=tpu_devices())
    compiled = _train_grad_compiled(mesh, tree)
    text = compiled.as_text()
    assert text.count(MOSAIC) >= 3
    assert not [m for m in SCORES.findall(text) if int(m) >= 128], "attention scores reached HBM"
    assert compiled.memory_analysis().temp_size_in_bytes < 96 * 2**20
    if tree:  # the tree kernels name themselves and state their FLOPs, which the step-time model counts
        assert hlo.kernel_names(text) == {f"tree_attention_{k}": 1 for k in ("forward", "dq", "dkv")}
        b, h, e = ROWS // 4, TPU_QWEN.num_heads, TPU_QWEN.head_dim
        blocks = tree_attention.choose_blocks("v5p", e, SEQ, SEQ)
        stated = sum(tree_attention.cost(k, b, h, SEQ, SEQ, e, 2, blocks).flops for k in ("forward", "dq", "dkv"))
        without = hlo.summarize(text.replace('"cost_estimate"', '"no_estimate"'), devices=4).flops
        layers = TPU_QWEN.num_layers
        assert hlo.summarize(text, devices=4).flops == pytest.approx(without + layers * stated)


@pytest.mark.parametrize("topology,chip", [("v5p:2x2x1", "v5p"), ("v6e:2x2", "v6e")])
def test_the_tpu_compiler_takes_each_chips_table_tile_and_states_its_cost(topology, chip):
    """The tree kernel's forward + backward alone on 4 abstract chips of each generation (``fsdp``=4, rows of
    1,024): the TPU compiler (Mosaic) accepts the table's tile (VMEM, layouts), and the program states the cost
    of that tile, read from the chip compiled for. Mutant caught: the tile chosen without the target's chip
    (the default 128 x 128 everywhere: other FLOPs)."""
    mesh = mesh_lib.make_mesh(data=1, fsdp=4, tensor=1, devices=tpu_devices(topology))
    b, t, h, kv, e = 4, 1024, 2, 1, 128
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_lib.batch_sharding(mesh))
    q, k, ends = spec(b, t, h, e), spec(b, t, kv, e), spec(b, t, dtype=jnp.int32)
    run = lambda q, k, ends: attention_lib.splash_attention(q, k, k, None, ends, True).astype(jnp.float32).sum()
    compiled = jax.jit(mesh_lib.traced_under(mesh, jax.grad(run, argnums=(0, 1)))).lower(q, k, ends).compile()
    blocks = tree_attention.choose_blocks(chip, e, t, t)
    assert blocks != tree_attention.DEFAULT_BLOCKS  # premise: the table gives this chip its own tile
    stated = sum(tree_attention.cost(n, b // 4, h, t, t, e, 2, blocks).flops for n in ("forward", "dq", "dkv"))
    text = compiled.as_text()
    assert hlo.kernel_names(text) == {f"tree_attention_{n}": 1 for n in ("forward", "dq", "dkv")}
    without = hlo.summarize(text.replace('"cost_estimate"', '"no_estimate"'), devices=4).flops
    assert hlo.summarize(text, devices=4).flops == pytest.approx(without + stated)


def _engine(devices, **axes):
    config = EngineConfig(max_slots=8, max_len=256, steps_per_call=4, page_size=16)
    return Engine.for_model(TPU_QWEN, config, SamplingLayout(mesh_lib.make_mesh(fsdp=1, devices=devices, **axes)))


@pytest.mark.parametrize("axes", [dict(data=4, tensor=1), dict(data=2, tensor=2)], ids=["data4", "data2_tensor2"])
def test_tpu_engine_decode_runs_the_paged_kernel_under_the_mesh(axes):
    """``Engine.lower_generate`` (the program ``generate`` runs) for v5p:2x2x1: the paged-attention kernel in
    ``shard_map`` (one Mosaic call in the layer scan), no CPU layer ``lax.switch`` (no ``conditional``), temporaries
    under 32 MiB (measured 4-5 MiB). Mutants caught: the kernel chosen by the host backend (no Mosaic call),
    the kernel left to XLA's partitioner ("Mosaic kernels cannot be automatically partitioned"), the CPU-only
    layer switch in a TPU program."""
    engine = _engine(tpu_devices(), **axes)
    assert engine.decode_attention == "pallas_paged" and engine.decode_kernel.shards == axes["data"]
    compiled = engine.lower_generate().compile()
    text = compiled.as_text()
    assert MOSAIC in text
    assert " conditional(" not in text
    assert compiled.memory_analysis().temp_size_in_bytes < 32 * 2**20


def test_tpu_engine_decode_at_head_dim_64_runs_the_paged_kernel():
    """Qwen2.5-0.5B's head_dim 64: ``Engine.lower_generate`` for v5p:2x2x1 (data 4) holds the paged-attention
    Mosaic call (``paged_attention_narrow``), not the reference gather. Mutant caught: head_dim 64 refused by
    ``paged_attention.problems`` again (the engine falls back, no Mosaic call)."""
    config = EngineConfig(max_slots=8, max_len=256, steps_per_call=4, page_size=16)
    narrow = dataclasses.replace(TPU_QWEN, head_dim=64)
    layout = SamplingLayout(mesh_lib.make_mesh(fsdp=1, devices=tpu_devices(), data=4, tensor=1))
    engine = Engine.for_model(narrow, config, layout)
    assert engine.decode_attention == "pallas_paged"
    assert MOSAIC in engine.lower_generate().compile().as_text()


def _producer(comps, name):
    """The instruction defining ``name`` in any computation of a parsed HLO module."""
    return next(i for c in comps.values() for i in c.instructions if i.name == name)


@pytest.mark.parametrize("axes", [dict(data=4, tensor=1), dict(data=2, tensor=2)], ids=["data4", "data2_tensor2"])
def test_tpu_engine_decode_hands_the_kernel_the_pool_in_place(axes):
    """The decode program compiled for v5p:2x2x1 gives the paged-attention kernel each shard's whole pool (every
    layer's pages, ``[kv_heads, layers * pages, page, head_dim]``), straight from the in-place write of the new
    token's keys / values (through bitcasts only), and nothing in the program has the shape of one layer's pages
    of a shard: no copy of a layer's slice per layer and step. Mutants caught: the kernel handed ``pool[layer]``
    (a dynamic-slice fusion of that shape feeds it), a pool kept as bits on TPU and viewed with
    ``bitcast_convert_type`` (a bitcast-convert copy of the whole pool feeds it)."""
    engine = _engine(tpu_devices(), **axes)
    mc, cfg = engine.model_config, engine.config
    kv_heads, pages = mc.num_kv_heads // axes["tensor"], cfg.pool_pages // axes["data"]
    text = engine.lower_generate().compile().as_text()
    comps, _ = hlo.parse(text)
    calls = [i for c in comps.values() for i in c.instructions if i.op == "custom-call" and MOSAIC in i.attrs]
    assert len(calls) == 1, f"premise: one Mosaic call (the kernel in the layer scan), got {len(calls)}"
    shapes = {i.name: i.type for c in comps.values() for i in c.instructions}
    page_operand = lambda dims: len(dims) == 4 and dims[::2] == [kv_heads, cfg.page] and dims[3] == mc.head_dim
    operands = [o for o in calls[0].operands if page_operand(hlo._dims(shapes.get(o, "")))]
    assert len(operands) == 2, "premise: the kernel reads keys and values, [kv_heads, pages, page, head_dim] each"
    for operand in operands:
        assert hlo._dims(shapes[operand])[1] == mc.num_layers * pages, f"{operand}: not every layer's pages"
        source = _producer(comps, operand)
        while source.op == "bitcast":
            source = _producer(comps, source.operands[0])
        root = None
        if source.op == "fusion":
            body = comps[next(t for k, t in hlo._callees(source.attrs) if k == "calls")]
            root = next(i for i in body.instructions if i.name == hlo._root_name(body)).op
        assert source.op in ("parameter", "get-tuple-element") or root in ("scatter", "dynamic-update-slice"), (
            f"the kernel's pages come from a {source.op} ({root}), not from the pool in place"
        )
    layer = [kv_heads, pages, cfg.page, mc.head_dim]
    sliced = [i.name for c in comps.values() for i in c.instructions if hlo._dims(i.type) == layer]
    assert not sliced, f"one layer's pages of a shard, {layer}, are materialised: {sliced[:4]}"


def test_the_cpu_program_keeps_the_cpu_path():
    """The same engine on this host's CPU device: no Mosaic call, the reference decode and the layer switch
    (``conditional``) kept; the training program has no Mosaic call either. Paired with the TPU tests above it
    catches a choice made by anything but the compile target (both would agree with one host backend)."""
    engine = _engine(jax.devices()[:1])
    assert engine.decode_kernel is None
    text = engine.lower_generate().compile().as_text()
    assert MOSAIC not in text and " conditional(" in text
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    graphdef, params = abstract_model(TPU_QWEN)
    params = _abstract(params, mesh_lib.state_shardings(params, mesh))
    rows = jax.ShapeDtypeStruct((2, SEQ), jnp.int32, sharding=mesh_lib.batch_sharding(mesh))
    loss = lambda p, t, e: nnx.merge(graphdef, p).hidden(t, kv_visible_end_bt=e)[0].astype(jnp.float32).sum()
    lowered = jax.jit(mesh_lib.traced_under(mesh, jax.grad(loss))).lower(params, rows, rows)
    assert "tpu_custom_call" not in lowered.as_text()


def test_the_tpu_grouped_matmul_matches_ragged_dot_in_value_and_both_gradients():
    """``grouped_matmul_tpu`` (the TPU branch of ``grouped_matmul``: ``ragged_dot`` with megablox's ``tgmm`` for
    the weight gradient, here in Pallas interpret mode) against ``jax.lax.ragged_dot`` and the CPU scan, float32:
    200 rows (padded to 2 row tiles inside), 185 of them in groups of sizes 0, 70, 0, 90, 25, 0 (empty first,
    middle and last experts, a group across a tile edge), then 15 padding rows that are non-zero in the input
    and in the output's cotangent; d = 384 (3 contraction tiles). Values and the input gradient equal
    ragged_dot's; the weight gradient matches to 1e-4 relative (measured ~3e-7: float32 sums in another order).

    Mutants caught: the weight gradient of group e taken from group e+1's rows (group sizes shifted one expert);
    the padding rows counted in the last group; an empty expert's gradient left unwritten."""
    rng = np.random.default_rng(0)
    sizes_e = jnp.asarray([0, 70, 0, 90, 25, 0], jnp.int32)
    m, d, f = 200, 384, 24
    x_md = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    w_edf = jnp.asarray(rng.normal(size=(6, d, f)), jnp.float32)
    d_out_mf = jnp.asarray(rng.normal(size=(m, f)), jnp.float32)

    def value_and_grads(matmul):
        out_mf, vjp = jax.vjp(lambda x, w: matmul(x, w, sizes_e), x_md, w_edf)
        return (out_mf, *vjp(d_out_mf))

    tpu = jax.jit(lambda: value_and_grads(lambda x, w, s: megablox.grouped_matmul_tpu(x, w, s, True)))()
    reference = value_and_grads(jax.lax.ragged_dot)
    cpu = value_and_grads(moe.grouped_matmul)  # the CPU branch on this host
    assert not np.asarray(reference[0][185:]).any() and np.asarray(reference[2][1]).any()  # premise
    np.testing.assert_array_equal(tpu[0], reference[0])
    np.testing.assert_array_equal(tpu[1], reference[1])
    scale = float(jnp.max(jnp.abs(reference[2])))
    for want in (reference[2], cpu[2]):
        np.testing.assert_allclose(tpu[2], want, rtol=0, atol=1e-4 * scale)
    assert not np.asarray(tpu[2][np.array([0, 2, 5])]).any()  # empty experts: zero gradient
