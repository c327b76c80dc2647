"""The HLO reader behind the step-time model, the chip table's bounds and the TPU slice names (no libtpu)."""

import dataclasses

import pytest

from trace_jax.models import ModelConfig
from trace_jax.plan import hlo
from trace_jax.plan.timing import CHIPS, matmul_params, model_flops_per_token, program_time
from trace_jax.plan.topology import parse_topology

# The shape of a TPU-compiled scan: a while loop whose condition compares the counter with 7, a dot fused in
# its body, an FSDP all-gather over a named mesh axis; a 2-branch conditional; a Mosaic kernel.
MODULE = """
HloModule jit_f

%fused_dot (param_0.1: bf16[256,1024], param_1.1: bf16[1024,512]) -> bf16[256,512] {
  %param_0.1 = bf16[256,1024]{1,0} parameter(0)
  %param_1.1 = bf16[1024,512]{1,0} parameter(1)
  ROOT %convolution.1 = bf16[256,512]{1,0} convolution(%param_0.1, %param_1.1), dim_labels=bf_io->bf
}

%body (p.1: (s32[], bf16[256,1024], bf16[256,512])) -> (s32[], bf16[256,1024], bf16[256,512]) {
  %p.1 = (s32[], bf16[256,1024]{1,0}, bf16[256,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p.1), index=0
  %x = bf16[256,1024]{1,0} get-tuple-element(%p.1), index=1
  %w = bf16[256,512]{1,0} get-tuple-element(%p.1), index=2
  %ag = bf16[1024,512]{1,0} all-gather(%w), replica_groups=mesh['fsdp'=4,'tensor'=2] {'fsdp'}, dimensions={0}
  %fusion.1 = bf16[256,512]{1,0} fusion(%x, %ag), kind=kOutput, calls=%fused_dot
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[256,1024]{1,0}, bf16[256,512]{1,0}) tuple(%next, %x, %w)
}

%cond (p.2: (s32[], bf16[256,1024], bf16[256,512])) -> pred[] {
  %p.2 = (s32[], bf16[256,1024]{1,0}, bf16[256,512]{1,0}) parameter(0)
  %i.2 = s32[] get-tuple-element(%p.2), index=0
  %seven = s32[] constant(7)
  ROOT %lt = pred[] compare(%i.2, %seven), direction=LT
}

%branch_a (a.1: f32[64,64]) -> f32[64,64] {
  %a.1 = f32[64,64]{1,0} parameter(0)
  ROOT %dot.a = f32[64,64]{1,0} dot(%a.1, %a.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_b (b.1: f32[64,64]) -> f32[64,64] {
  %b.1 = f32[64,64]{1,0} parameter(0)
  ROOT %neg.b = f32[64,64]{1,0} negate(%b.1)
}

ENTRY %main (x.0: bf16[256,1024], w.0: bf16[256,512], k.0: s32[], m.0: f32[64,64]) -> f32[64,64] {
  %x.0 = bf16[256,1024]{1,0} parameter(0)
  %w.0 = bf16[256,512]{1,0} parameter(1)
  %k.0 = s32[] parameter(2)
  %m.0 = f32[64,64]{1,0} parameter(3)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[256,1024]{1,0}, bf16[256,512]{1,0}) tuple(%zero, %x.0, %w.0)
  %while.1 = (s32[], bf16[256,1024]{1,0}, bf16[256,512]{1,0}) while(%init), condition=%cond, body=%body
  %kern = f32[64,64]{1,0} custom-call(%m.0), custom_call_target="tpu_custom_call", metadata={op_name="paged_attention"}
  ROOT %c = f32[64,64]{1,0} conditional(%k.0, %kern, %kern), branch_computations={%branch_a, %branch_b}
}
"""


def test_loops_count_their_trips_and_a_conditional_one_branch():
    """Fails if a while body is counted once (what ``cost_analysis()`` does: one layer of a scanned model),
    if the dot fused into the loop is missed, or if both branches of a conditional are counted in full."""
    summary = hlo.summarize(MODULE, devices=8)
    loop_flops = 7 * 2 * 256 * 512 * 1024
    branch_flops = 2 * 64 * 64 * 64 / 2  # one of two branches runs
    assert summary.loops == [7] and summary.unknown_loops == 0
    assert summary.flops == pytest.approx(loop_flops + branch_flops)


def test_collectives_count_their_bytes_per_run_and_their_group():
    """Fails if an all-gather's group is taken as the whole mesh (8) instead of its named axis (4), or if the
    collective inside the loop is counted once."""
    summary = hlo.summarize(MODULE, devices=8)
    gathered = 1024 * 512 * 2
    (kind,) = summary.collectives
    assert kind == "all-gather" and summary.collectives[kind]["count"] == 7
    assert summary.wire_bytes == pytest.approx(7 * gathered * 3 / 4)


def test_mosaic_kernels_are_found_by_name():
    """Fails if a ``tpu_custom_call`` goes unreported (a plan would say no kernel runs)."""
    assert hlo.summarize(MODULE, devices=8).kernels == {"paged_attention": 1}
    assert hlo.kernel_names(MODULE.replace("tpu_custom_call", "cpu_thing")) == {}


def test_a_program_time_is_its_largest_bound():
    """Fails if the bounds are summed, or a bound uses the wrong figure (ICI one way is half the bidirectional)."""
    chip = CHIPS["v5p"]
    t = program_time({"flops": chip.bf16_flops, "bytes_accessed": chip.hbm_bandwidth / 2, "wire_bytes": 0}, chip)
    assert (t["seconds"], t["bound"]) == (pytest.approx(1.0), "compute")
    t = program_time({"flops": 0, "bytes_accessed": 0, "wire_bytes": chip.ici_bandwidth}, chip)
    assert (t["seconds"], t["bound"]) == (pytest.approx(2.0), "communication")


def test_the_model_flop_count_leaves_out_the_input_embedding_lookup():
    """MFU's numerator: a token multiplies by every active weight but the input embedding table, which it only
    looks up (a tied table is the LM head and counts once). Qwen3-8B's compiled update (v5p-64, no remat) does
    0.99x the count that includes the lookup table, so that count put the roofline MFU above 100%. Fails if the
    lookup table is counted (the untied model then costs 6 x vocab x hidden more than the tied one)."""
    untied = ModelConfig.preset("qwen3-8b")
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    assert not untied.tie_word_embeddings and untied.active_params() - tied.active_params() == 151936 * 4096
    assert model_flops_per_token(untied, 2048) == model_flops_per_token(tied, 2048)
    assert matmul_params(untied) == untied.active_params() - 151936 * 4096


def test_slice_names_users_type_and_libtpu_names_agree():
    """Fails if a v5p/v4 name's number is taken as chips (it counts TensorCores), if a grid differs from Google's
    slice tables, or if an unknown name's error does not list the accepted forms."""
    cases = {"v5p-8": "v5p:2x2x1", "v5p-64": "v5p:2x4x4", "v5p-256": "v5p:4x4x8", "v6e-64": "v6e:8x8",
             "v6e-4": "v6e:2x2", "v5e-16": "v5e:4x4", "v5litepod-16": "v5e:4x4", "v4-32": "v4:2x2x4"}  # fmt: skip
    for name, libtpu in cases.items():
        assert parse_topology(name).libtpu_name == libtpu, name
    assert parse_topology("v5p:4x4x2").chips == parse_topology("v5p-64").chips == 32
    with pytest.raises(ValueError, match=r"unknown topology 'v7x-8'.*v5p-N.*v6e:AxB"):
        parse_topology("v7x-8")
    with pytest.raises(ValueError, match="unknown topology"):
        parse_topology("v6e:2x2x2")  # a 2D family
    with pytest.raises(ValueError, match="not a TPU slice"):
        _ = parse_topology("h100-8").libtpu_name


IN_PLACE = """
HloModule jit_g

%update (pool.1: bf16[64,1024,128], row.1: bf16[1,1,128], i.1: s32[]) -> bf16[64,1024,128] {
  %pool.1 = bf16[64,1024,128]{2,1,0} parameter(0)
  %row.1 = bf16[1,1,128]{2,1,0} parameter(1)
  %i.1 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[64,1024,128]{2,1,0} dynamic-update-slice(%pool.1, %row.1, %i.1, %i.1, %z)
}

ENTRY %main (pool.0: bf16[64,1024,128], row.0: bf16[1,1,128], i.0: s32[]) -> bf16[64,1024,128] {
  %pool.0 = bf16[64,1024,128]{2,1,0} parameter(0)
  %row.0 = bf16[1,1,128]{2,1,0} parameter(1)
  %i.0 = s32[] parameter(2)
  ROOT %f = bf16[64,1024,128]{2,1,0} fusion(%pool.0, %row.0, %i.0), kind=kLoop, calls=%update
}
"""


def test_a_buffer_updated_in_place_costs_its_update_not_the_buffer():
    """Fails if writing one token into a KV pool counts the whole pool read and written (16 MiB twice here):
    a decode step would look HBM-bound on the cache size instead of the bytes it touches."""
    summary = hlo.summarize(IN_PLACE, devices=1)
    assert summary.bytes_accessed <= 4 * 128 * 2 + 4, summary.bytes_accessed


# A Mosaic kernel that states its cost (``pl.CostEstimate``), called inside a named scope.
STATED = """
HloModule jit_k

ENTRY %main (q.0: bf16[8,128]) -> bf16[8,128] {
  %q.0 = bf16[8,128]{1,0} parameter(0)
  ROOT %k = bf16[8,128]{1,0} KERNEL
}
""".replace(
    "KERNEL",
    'custom-call(%q.0), custom_call_target="tpu_custom_call", '
    'metadata={op_name="jit(f)/shard_map/tree_attention_dq/pallas_call"}, backend_config={"custom_call_config":'
    '{"body":"abc","cost_estimate":{"flops":"1000000","transcendentals":"10","bytes_accessed":"5000"}}}',
)


def test_a_kernel_counts_the_flops_and_bytes_it_states_and_its_scope_names_it():
    """Fails if a Mosaic kernel's stated cost is ignored (attention FLOPs missing from the compute bound; its
    operands counted instead of what it reads) or if the kernel is named ``pallas_call`` instead of its scope."""
    summary = hlo.summarize(STATED, devices=1)
    assert (summary.flops, summary.bytes_accessed) == (1_000_000, 5000)
    assert summary.kernels == {"tree_attention_dq": 1}


def test_kernels_are_named_by_their_scope_not_by_jaxs_transformations():
    """Fails if a jitted kernel is named ``jit(tgmm)`` or an unnamed one by a transformation's scope (a plan
    listing ``shard_map`` or ``checkpoint`` as the kernels a program runs)."""
    assert hlo._kernel_name("jit(f)/transpose(jvp())/shard_map/cond/branch_0_fun/jit(tgmm)/pallas_call") == "tgmm"
    assert hlo._kernel_name("jit(f)/jvp()/while/body/closed_call/checkpoint/shard_map/pallas_call") == "pallas_call"
    assert hlo._kernel_name("jit(f)/shard_map/splash_attention/pallas_call") == "splash_attention"
    assert hlo._kernel_name("jit(f)/shard_map/ragged_dot_general/ragged-dot-none") == "ragged-dot-none"


# A scanned layer's matmul: the fusion takes the whole [8, 1024, 512] weight stack and reads layer i of it
# through a nested fusion's dynamic-slice (the form the TPU compiler gives a scan over stacked weights).
NESTED_SLICE = """
HloModule jit_h

%take (stack.2: bf16[8,1024,512], i.2: s32[]) -> bf16[1024,512] {
  %stack.2 = bf16[8,1024,512]{2,1,0} parameter(0)
  %i.2 = s32[] parameter(1)
  %z.2 = s32[] constant(0)
  %ds = bf16[1,1024,512]{2,1,0} dynamic-slice(%stack.2, %i.2, %z.2, %z.2), dynamic_slice_sizes={1,1024,512}
  ROOT %b = bf16[1024,512]{1,0} bitcast(%ds)
}

%matmul (stack.1: bf16[8,1024,512], i.1: s32[], x.1: bf16[16,1024]) -> bf16[16,512] {
  %stack.1 = bf16[8,1024,512]{2,1,0} parameter(0)
  %i.1 = s32[] parameter(1)
  %x.1 = bf16[16,1024]{1,0} parameter(2)
  %w = bf16[1024,512]{1,0} fusion(%stack.1, %i.1), kind=kLoop, calls=%take
  ROOT %y = bf16[16,512]{1,0} convolution(%x.1, %w), dim_labels=bf_io->bf
}

ENTRY %main (stack.0: bf16[8,1024,512], i.0: s32[], x.0: bf16[16,1024]) -> bf16[16,512] {
  %stack.0 = bf16[8,1024,512]{2,1,0} parameter(0)
  %i.0 = s32[] parameter(1)
  %x.0 = bf16[16,1024]{1,0} parameter(2)
  ROOT %f = bf16[16,512]{1,0} fusion(%stack.0, %i.0, %x.0), kind=kOutput, calls=%matmul
}
"""


def test_a_stack_read_through_a_nested_slice_costs_the_slice():
    """Fails if a fusion that reads one layer of a weight stack through a nested fusion's dynamic-slice counts
    the whole stack (the mutant: only direct slices of a fusion parameter recognised; a scanned model's decode
    step then counts every layer's weights at every layer, layers x its weights)."""
    summary = hlo.summarize(NESTED_SLICE, devices=1)
    layer, x, y = 1024 * 512 * 2, 16 * 1024 * 2, 16 * 512 * 2
    assert summary.bytes_accessed == pytest.approx(layer + x + y + 4)
    (top, *_) = hlo.byte_consumers(NESTED_SLICE)
    assert (top.name, top.op, top.bytes) == ("f", "fusion", summary.bytes_accessed)


# The paged-attention kernel's call: lengths s32[4], page table s32[32] (4 slots x 8 columns), two scalars,
# queries, then key and value pages [kv_heads 2, 1000 pages, page 16, head_dim 128] (every layer's pages).
PAGED = """
HloModule jit_p

ENTRY %main (n: s32[4], t: s32[32], a: s32[1], b: s32[1], q: f32[4,2,1,128], k: bf16[2,1000,16,128], v: bf16[2,1000,16,128]) -> f32[4,2,1,128] {
  %n = s32[4]{0} parameter(0)
  %t = s32[32]{0} parameter(1)
  %a = s32[1]{0} parameter(2)
  %b = s32[1]{0} parameter(3)
  %q = f32[4,2,1,128]{3,2,1,0} parameter(4)
  %k = bf16[2,1000,16,128]{3,2,1,0} parameter(5)
  %v = bf16[2,1000,16,128]{3,2,1,0} parameter(6)
  ROOT %pa = f32[4,2,1,128]{3,2,1,0} custom-call(%n, %t, %a, %b, %q, %k, %v), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/shard_map/jit(paged_attention)/pallas_call"}
}
"""  # noqa: E501


def test_the_paged_kernel_costs_the_pages_its_table_names():
    """Fails if the paged-attention kernel's call counts its whole page operands (the mutant: a pool of every
    layer handed to the kernel costs layers x a layer's pool per call) instead of the 32 pages its table names,
    of each of keys and values."""
    summary = hlo.summarize(PAGED, devices=1)
    pages = 2 * 32 * 2 * 16 * 128 * 2  # keys and values, 32 pages of [2 heads, 16, 128] bf16
    small = (4 + 32 + 1 + 1) * 4 + 2 * 4 * 2 * 128 * 4  # ints, queries and output
    assert summary.bytes_accessed == pytest.approx(pages + small)


# A layer's weight (bf16[512,128] = 128 KiB in HBM) prefetched into VMEM (``S(1)``) by four async slices and
# concatenated there, as the TPU compiler does with a layer's all-gathered weight; a small HBM -> VMEM copy;
# a matmul fusion reading both from VMEM and writing its [8,128] output to HBM. (Shapes from the v6e-64
# update's accumulate program: ``slice-start`` of ``s8[33554432]`` in eight ``s8[4194304]{...S(1)}`` slices.)
VMEM = """
HloModule jit_vmem

%dot_fusion (p0: bf16[512,128], p1: bf16[8,512]) -> bf16[8,128] {
  %p0 = bf16[512,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[8,512]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %d = bf16[8,128]{1,0:T(8,128)(2,1)} dot(%p1, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w.0: s8[131072], x.0: bf16[8,512]) -> bf16[8,128] {
  %w.0 = s8[131072]{0:T(1024)(128)(4,1)} parameter(0)
  %x.0 = bf16[8,512]{1,0:T(8,128)(2,1)} parameter(1)
  SLICES
  %w = bf16[512,128]{1,0:T(8,128)(2,1)S(1)} custom-call(%sd0, %sd1, %sd2, %sd3), custom_call_target="ConcatBitcast"
  %cs = (bf16[8,512]{1,0:T(8,128)(2,1)}, bf16[8,512]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%x.0)
  %cd = bf16[8,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  ROOT %out = bf16[8,128]{1,0:T(8,128)(2,1)} fusion(%w, %cd), kind=kOutput, calls=%dot_fusion
}
""".replace(
    "SLICES",
    "\n".join(
        f"  %ss{i} = ((s8[131072]{{0:T(1024)(128)(4,1)}}), s8[32768]{{0:T(1024)(128)(4,1)S(1)}}, s32[]{{:S(2)}}) "
        f"slice-start(%w.0), slice={{[{i * 32768}:{(i + 1) * 32768}]}}\n"
        f"  %sd{i} = s8[32768]{{0:T(1024)(128)(4,1)S(1)}} slice-done(%ss{i})"
        for i in range(4)
    ),
)


def test_arrays_the_compiler_placed_in_vmem_cost_no_hbm_bytes():
    """The weight is read from HBM once (its four slices, 128 KiB), the input once by the copy (8 KiB), and the
    matmul writes its output (2 KiB); nothing in ``S(1)`` (VMEM) is HBM traffic: 138 KiB in all, where counting
    every operand and output as HBM gives about 5x that (each slice-start's whole source, the concatenation
    read and written, the copy's destination, the fusion's VMEM operands). Mutants caught: memory spaces
    ignored (``hbm_bytes`` as ``type_bytes``), a ``slice-start`` costing its whole source."""
    assert hlo.hbm_bytes("bf16[8,128]{1,0:T(8,128)(2,1)S(1)}") == 0 < hlo.hbm_bytes("bf16[8,128]{1,0}") == 2048
    summary = hlo.summarize(VMEM, devices=1)
    assert summary.flops == 2 * 8 * 512 * 128
    assert summary.bytes_accessed == 131072 + 8 * 512 * 2 + 8 * 128 * 2, summary.bytes_accessed


def test_a_collective_between_vmem_buffers_still_crosses_the_interconnect():
    """An all-gather whose operand and result the compiler placed in VMEM moves no HBM bytes but still sends its
    bytes over ICI. Mutant caught: instructions with no FLOPs and no HBM bytes dropped before the collectives
    are counted (108 of the v6e-64 update's 440 all-gathers went missing that way)."""
    text = """
HloModule jit_ag

ENTRY %main (x.0: bf16[64,128]) -> bf16[256,128] {
  %x.0 = bf16[64,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %ag = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} all-gather(%x.0), dimensions={0}, replica_groups=[1,4]<=[4]
}
"""
    summary = hlo.summarize(text, devices=4)
    assert summary.bytes_accessed == 0
    assert summary.collectives["all-gather"] == {
        "count": 1,
        "bytes": 256 * 128 * 2,
        "wire_bytes": 256 * 128 * 2 * 3 / 4,
    }


# The TPU compiler's bidirectional windowed einsum (an all-gathered matmul computed chunk by chunk while the
# chunks travel both ways round the ring): its counter runs to 16 in steps of 2 (added to a copy of it).
STRIDED = """
HloModule jit_windowed

%cond (p.c: (u32[], bf16[8,128])) -> pred[] {
  %p.c = (u32[], bf16[8,128]{1,0}) parameter(0)
  %i.c = u32[] get-tuple-element(%p.c), index=0
  %limit = u32[] constant(16)
  ROOT %lt = pred[] compare(%i.c, %limit), direction=LT
}

%body (p.b: (u32[], bf16[8,128])) -> (u32[], bf16[8,128]) {
  %p.b = (u32[], bf16[8,128]{1,0}) parameter(0)
  %i.b = u32[] get-tuple-element(%p.b), index=0
  %x.b = bf16[8,128]{1,0} get-tuple-element(%p.b), index=1
  %two = u32[] constant(2)
  %i.copy = u32[] copy(%i.b)
  %next = u32[] add(%i.copy, %two)
  %d = bf16[8,128]{1,0} dot(%x.b, %x.b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %t = (u32[], bf16[8,128]{1,0}) tuple(%next, %d)
}

ENTRY %main (x.0: bf16[8,128]) -> bf16[8,128] {
  %x.0 = bf16[8,128]{1,0} parameter(0)
  %zero = u32[] constant(0)
  %init = (u32[], bf16[8,128]{1,0}) tuple(%zero, %x.0)
  %w = (u32[], bf16[8,128]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[8,128]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_loop_counting_in_steps_of_two_runs_half_its_limit():
    """A counter that runs to 16 in steps of 2 is 8 iterations: the matmul in the body counts 8 times. Mutant
    caught: the step ignored (16 iterations: the Qwen3-8B v5p-64 update's matmuls, all computed in such loops
    on fsdp 32, counted twice, its HLO FLOPs 1.82x the model's)."""
    summary = hlo.summarize(STRIDED, devices=1)
    assert summary.loops == [8]
    assert summary.flops == 8 * 2 * (8 * 128) * 128  # 8 iterations x 2 x output elements x contracted


# A layer of a scan saving two residuals for the backward pass: one fusion writes its slice of each stacked
# buffer in place (a tuple of two dynamic-update-slices; shapes cut down from the v5p-64 update's).
TWO_IN_PLACE = """
HloModule jit_save

%save (a.1: f32[36,64,128], b.1: bf16[36,64,128], x.1: bf16[1,64,128], i.1: s32[]) -> (f32[36,64,128], bf16[36,64,128])\
 {
  %a.1 = f32[36,64,128]{2,1,0} parameter(0)
  %b.1 = bf16[36,64,128]{2,1,0} parameter(1)
  %x.1 = bf16[1,64,128]{2,1,0} parameter(2)
  %i.1 = s32[] parameter(3)
  %z = s32[] constant(0)
  %xf = f32[1,64,128]{2,1,0} convert(%x.1)
  %ua = f32[36,64,128]{2,1,0} dynamic-update-slice(%a.1, %xf, %i.1, %z, %z)
  %ub = bf16[36,64,128]{2,1,0} dynamic-update-slice(%b.1, %x.1, %i.1, %z, %z)
  ROOT %t = (f32[36,64,128]{2,1,0}, bf16[36,64,128]{2,1,0}) tuple(%ua, %ub)
}

ENTRY %main (a.0: f32[36,64,128], b.0: bf16[36,64,128], x.0: bf16[1,64,128], i.0: s32[])\
 -> (f32[36,64,128], bf16[36,64,128]) {
  %a.0 = f32[36,64,128]{2,1,0} parameter(0)
  %b.0 = bf16[36,64,128]{2,1,0} parameter(1)
  %x.0 = bf16[1,64,128]{2,1,0} parameter(2)
  %i.0 = s32[] parameter(3)
  ROOT %f = (f32[36,64,128]{2,1,0}, bf16[36,64,128]{2,1,0}) fusion(%a.0, %b.0, %x.0, %i.0), kind=kLoop, calls=%save
}
"""


def test_a_fusion_writing_several_stacks_in_place_costs_their_updates():
    """Each output of the fusion is a stack written one layer at a time: it costs its update read and written
    (f32 and bf16 [1,64,128]) and its input, not the stacks (2.3 MiB and 1.2 MiB a layer). Mutant caught: a
    tuple of in-place updates counted as whole outputs (the v5p-64 update's saved residuals: 176 GB a call
    for one such fusion)."""
    summary = hlo.summarize(TWO_IN_PLACE, devices=1)
    assert summary.bytes_accessed == 64 * 128 * 2 + 2 * 64 * 128 * 4 + 2 * 64 * 128 * 2 + 4, summary.bytes_accessed
