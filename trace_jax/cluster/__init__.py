"""Where sampling runs beside training: the RL cluster below the job.

``placement`` splits a host's devices between the trainer and the sampling side; ``pipeline`` hands sampled
trees from the sampling side to the trainer, one step ahead when ``rl.max_staleness`` allows; ``processes``
starts and talks to sampling processes; ``sharded_rollouts`` splits a step's rollouts across JAX processes.
"""
