"""After each RL update the engine holds the updated policy: the evaluation after a step (the final one included)
scores the weights that step produced, with or without sampling ahead.

``Training.rl_step`` runs here with its collaborators replaced by recorders (the trainer's update adds one to a
counter that stands for the weights; the sampler remembers what it was last given), so the test takes
milliseconds and pins exactly which weights the engine holds when the evaluation runs.
"""

import contextlib
import types

import pytest

from trace_jax.cluster.pipeline import RolloutPipeline, Sampled
from trace_jax.job import training
from trace_jax.job.training import Training


class Recorder:
    """The sampling side: it holds the last weights it was given; its evaluation reports them."""

    layout = None

    def __init__(self):
        self.weights = None
        self.evaluated_with = []

    def set_weights(self, weights):
        self.weights = weights

    def sample(self, step, version):
        trees = types.SimpleNamespace(trees=[], metrics={})
        return Sampled(step, version, trees, evicted_holds=0, started=0.0, ended=0.0)

    def sampled_questions(self, trees):
        return []

    def state_dict(self):
        return {}

    def evaluate(self, tasks, chunk, progress=None):
        self.evaluated_with.append(self.weights)
        return [{"group": "all", "n": 0, "em": 0.0, "f1": 0.0}]


class State(types.SimpleNamespace):
    """The train state: ``params`` is the policy version the updates have reached (an int stands for weights)."""


def _run(max_staleness, steps, monkeypatch):
    for name, fake in {
        "compute_advantages": lambda config, trees: [],
        "build_batch": lambda *a, **k: (
            None,
            types.SimpleNamespace(
                path_tokens=None, skipped_denominator=0, num_rows=0, num_trained_tokens=0, num_trees_skipped=0
            ),
        ),
        "figures": types.SimpleNamespace(
            effective_ratio=lambda t: 0.0, nonzero_advantage_share=lambda t: {"tokens": 0}
        ),
        "np": types.SimpleNamespace(concatenate=lambda parts: types.SimpleNamespace(mean=lambda: 0.0, size=0)),
    }.items():
        monkeypatch.setattr(training, name, fake)
    run = Training.__new__(Training)
    run.config = types.SimpleNamespace(
        rl=types.SimpleNamespace(advantage=None, steps=steps),
        eval=types.SimpleNamespace(split="test", num_questions=1, every=0),
        engine=types.SimpleNamespace(max_slots=1),
    )
    run.step, run.state = 0, State(params=0)
    run.trainer = types.SimpleNamespace(
        prepare=lambda state, batch, behaviour_params=None: batch,
        recomputes_behaviour=False,
        update=lambda state, *a, **k: (State(params=state.params + 1), {}),
        loss_config=None,
        micro_rows=1,
    )
    run.sampling_params = None
    run.batch_config = None
    run.sampler = Recorder()
    run.placement = types.SimpleNamespace(to_engine=lambda weights, layout: weights)
    run.processes = types.SimpleNamespace(engine_weights=lambda params, layout: params, reduce=lambda m: m)
    run.world = types.SimpleNamespace(world=types.SimpleNamespace(questions=lambda split: ["q"]))
    run.timer = types.SimpleNamespace(phase=lambda name: contextlib.nullcontext())
    run.console = types.SimpleNamespace(progress=lambda *a, **k: types.SimpleNamespace(close=lambda: None))
    run.engine_version = -1
    run.saved_step, run._completed, run._primed = 0, None, None  # checkpointed at step 0 only
    run._sync_weights()
    # Checkpoints and evaluations only at the last step: with k >= 1 every other step samples ahead.
    run.pipeline = RolloutPipeline(run.sampler.sample, max_staleness, lambda step: step == steps)
    return run


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_evaluation_after_each_step_scores_the_weights_that_step_produced(max_staleness, monkeypatch):
    """Catches mutant M11, the post-update weight sync skipped (``rl_step``'s ``self._sync_weights()`` after the
    update): rollouts still re-sync lazily before they sample, but every evaluation after a step, the final one
    included, would run on weights one update old (here: version 2 after step 3)."""
    steps = 3
    run = _run(max_staleness, steps, monkeypatch)
    try:
        for step in range(1, steps + 1):
            run.rl_step()
            assert run.step == run.state.params == step  # premise: each update moves the weights
            if not run.pipeline.in_flight:  # where an evaluation may run (always with k = 0; the last step with 1)
                run.evaluate(f"evaluation at step {step}")
                assert run.sampler.evaluated_with[-1] == step and run.engine_version == step
        assert run.sampler.evaluated_with[-1] == steps  # the final evaluation: the trained policy
        assert len(run.sampler.evaluated_with) == (steps if max_staleness == 0 else 1)
    finally:
        run.pipeline.close()
