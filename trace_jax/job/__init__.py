"""The main job: a run built from its config, warm-started, trained with TRACE, evaluated, written to its workdir.

``commands`` parses the command lines of ``python -m trace_jax.train``, ``trace_jax.evaluate`` and ``trace_jax.hf``;
``train`` orchestrates a run (``train.train(config, workdir)``); ``training`` holds the run's ``Training``: its state
between RL steps and the step itself; ``build`` builds its parts (world, tokenizer, environment, engine, runners,
scheduler) from the config; ``recipes`` says where the policy, tokenizer, questions and retriever come from (the
synthetic world or a Hugging Face checkpoint with Search-R1 data); ``sft`` and ``warm_start`` train and cache the
synthetic recipe's warm start; ``evaluate`` scores a policy; ``sampling`` and ``sampling_process`` are the sampling
side (in process or in processes of its own, placed by ``trace_jax.cluster``); the run's typed ``RunConfig``, its
checks and its docs come through ``trace_jax.configs``; ``rundir`` guards the workdir; ``cli`` is the console (exit
codes, one-line errors, progress bars); ``metrics`` writes TensorBoard, jsonl and plots; ``heap`` returns freed memory
to the OS between phases.
"""
