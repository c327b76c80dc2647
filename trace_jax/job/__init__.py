"""The main job: build a run from its config, warm-start, train with TRACE, evaluate, write the run."""
