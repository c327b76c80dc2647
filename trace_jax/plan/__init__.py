"""Will it fit: per-device memory of the real train step and engine, from XLA's own memory analysis.

``python -m trace_jax.plan --model qwen3-8b --topology v5p-64 --rows 256 --seq-len 4096`` builds abstract
parameters (shapes, dtypes and shardings only; nothing allocated), lowers and compiles the real
``RLTrainer`` step and the real ``Engine.generate`` for candidate meshes on fake CPU devices, reads
``compiled.memory_analysis()`` and picks the mesh, micro-batching and remat policy that fit the chip's
memory with a margin (or says that nothing fits). CPU-compiled memory is an estimate of TPU memory: XLA:TPU
schedules, fuses and pads differently.

``topology`` is the table of slices and GPUs (chips, memory per chip), ``compile`` the abstract state and
the compiled-memory breakdown, ``__main__`` the search and the command line. Importing this package does
not import jax (the command line sets the fake device count first).
"""
