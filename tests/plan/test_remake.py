"""The committed plans: one registry makes them all, each agrees with itself, rooflines carry calibrated estimates."""

import copy
import gzip
import json
import os

import pytest

from tests.test_docs import reference_figures
from trace_jax.plan import calibration, figures, hlo, remake
from trace_jax.plan import compile as plan_compile
from trace_jax.plan.__main__ import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN_DIR = os.path.join(ROOT, remake.PLAN_DIR)


def _committed() -> dict[str, dict]:
    plans = {}
    for file in sorted(os.listdir(PLAN_DIR)):
        if file.endswith(".json") and file not in remake.OTHER_FILES:
            with open(os.path.join(PLAN_DIR, file)) as f:
                plans[file.removesuffix(".json")] = json.load(f)
    return plans


def test_every_committed_plan_is_a_row_made_by_its_command_and_agrees_with_itself():
    plans = _committed()
    assert plans, "no committed plans"
    for name, plan in plans.items():
        assert name in remake.ROWS, f"docs/plans/{name}.json is no row of trace_jax.plan.remake.ROWS"
        row = remake.ROWS[name]
        assert (plan["row"], plan["kind"], plan["command"]) == (row.name, row.kind, row.command), name
        assert remake.check(plan, row.kind) == [], name


def test_every_rl_row_compiles_both_programs_in_one_command():
    """Fails if a row asks for no slots (the engine and the RL step's decode phase go missing)."""
    rows = [r for r in remake.ROWS.values() if r.kind == "rl"]
    assert rows
    for row in rows:
        args = build_parser().parse_args(list(row.argv))
        assert args.rows > 0 and args.slots > 0, row.command


def _rl_plan() -> dict:
    return {
        "train": {"fits": {"program": "update"}},
        "engine": {"fits": {"program": "generate"}},
        "timing": {"rl_step": {"phases_s": {"update": 3.0, "prefill": 0.1, "decode": 20.0}}},
    }


def test_a_plan_whose_rl_split_lacks_decode_fails_the_check():
    plan = _rl_plan()
    assert remake.check(plan, "rl") == []
    without_slots = copy.deepcopy(plan)  # what --slots 0 gives: no engine, no decode phase
    without_slots["engine"]["fits"] = None
    del without_slots["timing"]["rl_step"]["phases_s"]["decode"]
    problems = remake.check(without_slots, "rl")
    assert any("engine" in p for p in problems) and any("decode phase" in p for p in problems), problems


def test_an_unknown_row_is_refused_with_the_rows_named():
    with pytest.raises(SystemExit, match="qwen3-8b_v5p-64"):
        remake.ordered(["no-such-row"])


def test_every_anchor_is_compiled_by_a_row():
    assert all(a.row in remake.ROWS for a in calibration.ANCHORS.values())


def test_the_calibrated_estimate_is_the_roofline_times_the_nearest_anchors_attained_fraction():
    anchor = calibration.ANCHORS["sglang-jax-qwen3-8b-v6e-4-c64"]
    decode_plan = {
        "topology": {"chips": 4},
        "timing": {"chip": "v6e", "decode": {"tokens_per_s": 10000.0, "slots": 64}},
    }
    low = calibration.attained(anchor, decode_plan)
    assert low["attained_fraction"] == pytest.approx(anchor.measured / 10000.0) and low["slots_per_chip"] == 16
    high = {**low, "attained_fraction": 0.9, "slots_per_chip": 64}
    fractions = {"low": low, "high": high, "mfu": {"program": "update", "attained_fraction": 0.5}}
    timing = {"decode": {"tokens_per_s": 2000.0, "slots": 80}, "update": {"mfu": 0.4}}
    out = calibration.calibrated(timing, 4, fractions)  # 20 slots a chip: nearer 16 than 64
    assert out["decode"]["anchor"] == "low"
    assert out["decode"]["upper_bound"] == 2000.0
    assert out["decode"]["calibrated_estimate"] == pytest.approx(2000.0 * low["attained_fraction"])
    assert out["update"]["calibrated_estimate"] == pytest.approx(0.2) and out["update"]["upper_bound"] == 0.4


def test_committed_plans_carry_the_committed_fractions():
    fractions = calibration.load()
    plans = _committed()
    assert set(fractions) == {n for n, a in calibration.ANCHORS.items() if a.row in plans}
    assert fractions, "no anchor's row committed"
    for name, plan in plans.items():
        assert plan["timing"]["calibrated"] == calibration.calibrated(
            plan["timing"], plan["topology"]["chips"], fractions
        ), f"{name}: re-run python -m trace_jax.plan.remake --calibrate-only"


def test_the_benchmarks_page_quotes_each_plan_figure_as_its_committed_plan_reads():
    """Each ``trace_jax.plan.figures`` figure whose plan is committed stands on docs/benchmarks.md under its
    anchor with the value the plan gives (the README quotes those anchors; tests/test_docs.py checks the
    quotes). Mutant caught: a figure read with another rounding or from another program."""
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        page, _ = reference_figures({"benchmarks.md": f.read()})
    found = figures.values(PLAN_DIR)
    assert found
    for anchor, value in found.items():
        assert page.get(f"benchmarks.md#{anchor}") == value, f"{anchor}: run python -m trace_jax.plan.figures"


# One decode step's matmul, the engine's whole program in this stand-in: 2 x 8 x 128 x 1,024 FLOPs, 2 MiB of
# bf16 weights read.
STAND_IN = """
HloModule jit_generate

ENTRY %main (x.0: bf16[8,1024], w.0: bf16[1024,1024]) -> bf16[8,1024] {
  %x.0 = bf16[8,1024]{1,0} parameter(0)
  %w.0 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[8,1024]{1,0} dot(%x.0, %w.0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_recount_rereads_a_plans_programs_from_their_kept_hlo_and_recomputes_its_times(tmp_path):
    """A committed decode row re-counted from a kept HLO text (a stand-in, so the figures must move): the
    engine's counts become that text's and the decode rate follows from them, no compile. Mutant caught: the
    engine's program left out of the re-count (only the update's programs re-read)."""
    row = remake.ROWS["qwen3-8b_v6e-4_decode-64"]
    plan_dir, hlo_dir = tmp_path / "plans", tmp_path / "hlo"
    (hlo_dir / row.name).mkdir(parents=True)
    plan_dir.mkdir()
    with open(os.path.join(remake.PLAN_DIR, f"{row.name}.json")) as f:
        before = json.load(f)
    (plan_dir / f"{row.name}.json").write_text(json.dumps(before))
    (hlo_dir / row.name / "generate_0.hlo.txt.gz").write_bytes(gzip.compress(STAND_IN.encode()))
    after = remake.recount(row, str(hlo_dir), str(plan_dir))
    want = hlo.summarize(STAND_IN, devices=4).as_dict()
    assert (
        after["engine"]["fits"]["hlo"] == want
        and want["bytes_accessed"] < before["engine"]["fits"]["hlo"]["bytes_accessed"]
    )
    assert after["timing"]["decode"]["tokens_per_s"] > before["timing"]["decode"]["tokens_per_s"]
    assert json.loads((plan_dir / f"{row.name}.json").read_text())["timing"] == after["timing"]


@pytest.mark.skipif(not plan_compile.libtpu_available(), reason="the rows' planners read TPU slices: needs libtpu")
def test_every_committed_plans_times_follow_from_its_counts_by_the_current_model(tmp_path):
    """Each committed plan's ``timing`` is what the current step-time model and model FLOP count make of the
    program counts it holds. Fails when either changes and a plan keeps its old times (``remake --retime``
    re-applies them); mutant caught: the FLOP count with the input embedding table back in (every update
    row's MFU moves)."""
    for row in remake.ROWS.values():
        with open(os.path.join(remake.PLAN_DIR, f"{row.name}.json")) as f:
            committed = json.load(f)
        (tmp_path / f"{row.name}.json").write_text(json.dumps(committed))
        again = remake.retime(row, str(tmp_path))
        assert json.loads(json.dumps(again["timing"])) == committed["timing"], f"{row.name}: run remake --retime"
