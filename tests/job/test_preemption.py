"""SIGTERM as a preemption notice (``trace_jax.job.cli.Termination``): outside a grace it stops at once, inside one
the work goes on until the caller stops or the grace runs out; either way the exit code is 143.

The warm start's side (a SIGTERM during SFT keeps its progress; the rerun ends bit-identical) is the last test here.
The main job's side (a SIGTERM during an RL step checkpoints it, or the completed step before it when the step is
abandoned, exits 143, and the rerun equals the uninterrupted run) is ``tests/job/test_train.py``; with rollouts
sampled ahead, ``tests/job/test_overlap_job.py``; the pod launcher's relaunch is ``tests/test_launch.py``.
"""

import os
import signal
import time

import jax
import numpy as np
import pytest

from trace_jax.job.cli import Console, ExitCode, Preempted, Termination, run_main


@pytest.fixture
def termination():
    """A fresh Termination installed as this process's SIGTERM handler (the previous handler restored after)."""
    fresh = Termination()
    previous = signal.signal(signal.SIGTERM, fresh.handle)
    try:
        yield fresh
    finally:
        signal.signal(signal.SIGTERM, previous)


def sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


def wait_for(condition, seconds=60.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not condition():
        time.sleep(0.01)


def test_outside_a_grace_a_sigterm_interrupts_at_once(termination):
    with pytest.raises(KeyboardInterrupt):
        sigterm()
        wait_for(lambda: False, 30)  # the handler raises here, long before this ends
    assert termination.requested


def test_inside_a_grace_a_sigterm_only_asks_to_stop(termination):
    """Catches a handler that interrupts inside the grace: the step under way would be lost."""
    with termination.grace(600):
        sigterm()
        wait_for(lambda: termination.requested)
        assert termination.requested
        time.sleep(0.2)  # the work goes on
    assert termination._timer is None  # leaving the grace disarms the deadline


def test_a_step_still_running_when_the_grace_runs_out_is_abandoned(termination):
    """Catches a grace with no deadline: a step longer than the notice would be killed mid-checkpoint instead."""
    with pytest.raises(KeyboardInterrupt), termination.grace(0.1):
        sigterm()
        wait_for(lambda: False, 60)  # a step that would run on: interrupted after ~0.1 s
    assert termination.requested


def test_an_interrupt_lost_in_a_gc_callback_is_repeated_until_the_step_is_abandoned(termination):
    """Python drops a KeyboardInterrupt raised while a garbage-collector callback runs (JAX installs one; with a
    collection running in a loop, 4 to 5 of 60 one-shot deadlines were lost). Catches a deadline that interrupts
    once: the first interrupt is swallowed here as such a callback would, and the second must still come."""
    with pytest.raises(KeyboardInterrupt), termination.grace(0.05):
        sigterm()
        try:
            wait_for(lambda: False, 30)
        except KeyboardInterrupt:
            pass  # the first interrupt, lost
        else:
            pytest.fail("premise: the grace's deadline interrupts at all")
        wait_for(lambda: False, 30)  # interrupted again about a second later
    assert termination._timer is None  # leaving the grace stops the repeats


def test_the_deadline_interrupts_a_job_started_in_the_background_with_sigint_ignored(termination):
    """A script that starts the job with ``&`` (``launch/tpu_worker.sh`` does) leaves SIGINT ignored in it, and
    Python then raises nothing for a simulated SIGINT. Catches a deadline sent as SIGINT (``interrupt_main()``):
    the step would run on past the grace."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), termination.grace(0.05):
            sigterm()
            wait_for(lambda: False, 30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert termination.requested and termination._timer is None


def test_run_main_exits_143_after_a_sigterm_and_130_after_ctrl_c(monkeypatch):
    from trace_jax.job import cli

    console = Console(verbosity=-1)
    monkeypatch.setattr(cli, "TERMINATION", Termination())
    previous = signal.getsignal(signal.SIGTERM)  # run_main installs its own handler

    def preempted():
        raise Preempted("stopped by SIGTERM after RL step 2; rerun")

    assert run_main(preempted, console) == ExitCode.PREEMPTED == 143

    def interrupted():
        raise KeyboardInterrupt

    assert run_main(interrupted, console) == ExitCode.INTERRUPTED == 130  # Ctrl-C: no SIGTERM seen

    def terminated():
        sigterm()  # outside any grace: KeyboardInterrupt at once, but it was a SIGTERM
        wait_for(lambda: False, 30)

    try:
        assert run_main(terminated, console) == ExitCode.PREEMPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_graces_nest_and_leaving_the_inner_one_restores_the_outer(termination):
    """Catches an inner grace that, on leaving, drops the outer one: a SIGTERM between steps (outside the step's
    own grace, inside the loop's) would then interrupt at once instead of stopping at the loop's check."""
    with termination.grace(float("inf")):
        with termination.grace(600):
            pass
        sigterm()
        wait_for(lambda: termination.requested)
        time.sleep(0.2)  # no KeyboardInterrupt: the loop's grace holds
    assert termination.requested


def test_a_sigterm_whose_interrupt_was_swallowed_still_stops_at_the_next_phase_boundary(termination):
    """A KeyboardInterrupt raised while a gc callback runs (JAX's ``_xla_gc_callback``) is printed and ignored: a
    SIGTERM 1.5 s into the tiny main job let its setup run to the end (warm start, evaluation) before it stopped,
    far past the grace. Catches a ``stop_if_requested`` that does not raise after a swallowed notice, or that
    raises inside a grace."""
    termination.stop_if_requested()  # no notice: nothing happens
    try:
        sigterm()
        wait_for(lambda: False, 30)
    except KeyboardInterrupt:
        pass  # swallowed, as a catch-all would
    assert termination.requested
    with termination.grace(600):
        termination.stop_if_requested()  # inside a grace the step under way goes on
    with pytest.raises(KeyboardInterrupt):
        termination.stop_if_requested()


class SigtermAfterStep:
    """A progress bar that sends this process a SIGTERM once ``step`` SFT steps are done (a fixed point: no timing)."""

    def __init__(self, step):
        self.step, self.done = step, 0

    def update(self, n):
        self.done += n
        if self.done == self.step:
            sigterm()

    def set_postfix(self, **values):
        pass


def test_sigterm_during_the_warm_start_saves_its_progress_and_the_rerun_ends_bit_identical(
    termination, monkeypatch, tmp_path
):
    """SFT (the warm start) stopped by a SIGTERM during step 5 of 12: that step finishes, the progress (params,
    optimizer state, the batch sampler's position) is saved at step 5 and the rerun continues from it to the very
    params and losses of an uninterrupted warm start. Catches a SIGTERM that throws the warm start's progress away
    (the rerun starts at step 0), and a resume that restarts the optimizer or the batch order."""
    from trace_jax.checkpoint.state import StateCheckpointer
    from trace_jax.data.synthetic import SyntheticWorld, WorldConfig
    from trace_jax.data.tokenizer import train_world_tokenizer
    from trace_jax.job import sft

    monkeypatch.setattr(sft, "TERMINATION", termination)
    world = SyntheticWorld(WorldConfig(scale=1, questions_per_hop=8, ood_questions=2, max_hops=2, ood_hops=3))
    tokenizer = train_world_tokenizer(world, tmp_path / "tok", vocab_size=300)
    config = sft.SFTConfig(
        batch_size=4, max_steps=12, warmup_steps=2, log_every=2, practice_worlds=0, bucket_multiple=512
    )
    reference = sft.run_sft(config, world, tokenizer, tmp_path / "reference")

    with pytest.raises(KeyboardInterrupt):
        sft.run_sft(config, world, tokenizer, tmp_path / "preempted", progress=SigtermAfterStep(5))
    assert termination.requested
    saved = StateCheckpointer(tmp_path / "preempted" / "sft").all_steps()
    assert saved == [5]  # the step under way finished and was kept: nothing lost
    termination.reset()
    resumed = sft.run_sft(config, world, tokenizer, tmp_path / "preempted")
    assert not resumed.restored and resumed.steps == 12 and resumed.reproducible
    assert resumed.losses == reference.losses
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = sft.run_sft(config, world, tokenizer, tmp_path / "preempted")  # finished: reused as it is
    assert again.restored and again.steps == 12
