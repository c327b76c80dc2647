"""DCN accounting on hand-written HLO: a collective counts as cross-slice when a replica group spans two slices,
and a MegaScale host transfer always does; loops multiply."""

from trace_jax.plan.dcn import dcn_traffic, replica_groups
from trace_jax.plan.multislice import dcn_against_compute

SEND = (
    "%send = (f32[256], u32[], token[]) send(%a, %tok), channel_id=1, is_host_transfer=true, "
    'frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}'
)
HLO = """
%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]) parameter(0)
  %x = f32[256] get-tuple-element(%p), index=1
  %ici = f32[256] all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add
  %dcn = f32[256] all-reduce(%ici), replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[256]) tuple(%i, %dcn)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p = (s32[], f32[256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[256]) -> f32[256] {
  %a = f32[256] parameter(0)
  %tok = token[] after-all()
  SEND
  %zero = s32[] constant(0)
  %init = (s32[], f32[256]) tuple(%zero, %a)
  %loop = (s32[], f32[256]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[256] get-tuple-element(%loop), index=1
}
""".replace("SEND", SEND)


def test_replica_group_forms():
    assert replica_groups("replica_groups={{0,1},{2,3}}, to_apply=%add", 4) == [[0, 1], [2, 3]]
    assert replica_groups("replica_groups=[2,2]<=[2,2]T(1,0), to_apply=%add", 4) == [[0, 2], [1, 3]]
    assert replica_groups("to_apply=%add", 4) == [[0, 1, 2, 3]]


def test_only_groups_spanning_slices_and_megascale_transfers_count():
    # 4 devices, 2 slices of 2: {0,1} and {2,3} stay inside a slice; the iota groups {0,2}, {1,3} cross.
    traffic = dcn_traffic(HLO, devices=4, slices=2)
    assert traffic.by_kind["all-reduce"]["count"] == 3  # the loop's 3 trips of the crossing reduction only
    assert traffic.by_kind["all-reduce"]["bytes"] == 3 * 256 * 4
    assert traffic.by_kind["ALL_REDUCE"] == {"count": 1, "bytes": 256 * 4, "wire_bytes": 256 * 4}
    assert dcn_traffic(HLO, devices=4, slices=1).count == 0


def test_dcn_time_is_set_against_one_optimizer_steps_compute():
    # The timing's optimizer_step_s is an epoch: every mini-batch's micro-batches and apply; a step is a share.
    timing = {"update": {"optimizer_step_s": 4.0}}
    got = dcn_against_compute(1e9, 50.0, timing, {"mini_batches": 2})
    assert got["predicted_dcn_s"] == 1e9 * 8 / 50e9
    assert got["optimizer_step_compute_s"] == 2.0 and got["dcn_over_compute"] == got["predicted_dcn_s"] / 2.0
    assert dcn_against_compute(1e9, 50.0, None, {"mini_batches": 2})["dcn_over_compute"] is None
