"""The console's progress bars: "compiling" and no ETA until a phase's first step is done, then a rate that
leaves the compiling step's time out (a fake clock, so nothing here depends on the machine's speed)."""

import io
import re

from trace_jax.job.cli import Console


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_bar_says_compiling_until_its_first_step_then_times_the_steps_after_it():
    out, clock = io.StringIO(), FakeClock()
    bar = Console(stream=out).progress(100, "warm start (SFT)")
    bar._time, bar.start_t, bar.last_print_t = clock, clock(), clock()
    clock.now += 30.0  # the first step compiles: 30 s
    bar.refresh()
    compiling = out.getvalue()
    assert "compiling" in compiling and "step/s" not in compiling and "<" not in compiling  # no rate, no ETA
    bar.update(1)
    for _ in range(9):  # then 0.1 s a step
        clock.now += 0.1
        bar.update(1)
    bar.refresh()
    line = out.getvalue().split("\r")[-1]
    # Premise: over all 10 steps the rate would be 10 / 30.9 s = 0.3 step/s and the ETA about 5 minutes (a plain
    # tqdm bar shows that); from the steps after the first it is 10 step/s and 9 s.
    assert "10.00step/s" in line and re.search(r"<00:0[89],", line), line  # 90 steps left at 10 a second
    assert "(first step 30 s)" in line and "compiling" not in line
    bar.close()


def test_a_quiet_console_has_no_bar():
    out = io.StringIO()
    with Console(verbosity=-1, stream=out).progress(3, "evaluation") as bar:
        bar.update(1)
    assert out.getvalue() == ""
