"""Test helpers: tiny random Hugging Face Qwen checkpoints built and saved locally (nothing downloaded)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from trace_jax.bench.overlap import TINY_WORLD
from trace_jax.checkpoint.ranged import ST_DTYPES
from trace_jax.job.cli import ExitCode
from trace_jax.job.commands import train_main

# The main job on a tiny world whose 200-step warm start answers about a third of its training questions, so
# rollout rewards are mixed and RL gradients non-zero (tests of the whole job add their step counts).
TINY_MAIN_JOB = [
    *TINY_WORLD,
    "--config.engine.max_slots=8",
    "--config.engine.append_windows=(512,)",  # one append window: 7 append programs to compile, not 18
    "--config.allocation.rollouts_per_prompt=3.0",
    "--config.rl.prompts_per_step=4",
    "--config.eval.num_questions=6",
    "--config.eval.every=0",
]


def fake_cpu_devices(devices: int) -> str:
    """XLA_FLAGS for ``devices`` CPU devices in one process. XLA:CPU aborts a collective whose devices do not all
    arrive within 40 s, which a loaded 2-core machine running several such processes can exceed: the limit is
    raised so that a run's outcome does not depend on the machine's load."""
    return (
        f"--xla_force_host_platform_device_count={devices}"
        " --xla_cpu_collective_call_warn_stuck_timeout_seconds=600"
        " --xla_cpu_collective_call_terminate_timeout_seconds=3600"
    )


def cpu_fingerprint() -> str:
    """The host CPU as XLA:CPU compiles for it: model name and instruction-set flags (a digest of them)."""
    import hashlib

    info = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{model or 'unknown'} / flags {hashlib.sha256(' '.join(sorted(flags)).encode()).hexdigest()[:12]}"


def summary_digest(summary: dict[str, Any]) -> str:
    """A short digest of a run's reproducible summary, quoted in the README beside the figures it backs."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:12]


def main_job_command(workdir: Any, cache: Any, flags: list[str]) -> list[str]:
    """``python -m trace_jax.train`` in ``workdir`` with its warm start cached in ``cache`` and ``flags``."""
    import sys

    return [
        sys.executable,
        "-m",
        "trace_jax.train",
        f"--workdir={workdir}",
        f"--config.warm_start.cache_dir={cache}",
        *flags,
    ]


def build_hf_checkpoint(
    path: str | pathlib.Path, family: str = "qwen3", seed: int = 0, max_shard_size: str | None = None, **overrides: Any
):
    """Builds a random tiny ``Qwen2``/``Qwen3``/``Qwen3-MoE`` transformers model, ``save_pretrained``s it to ``path``.

    Returns the torch model (eval mode) so a test can compare against it. ``overrides`` are HF config fields
    (family "qwen3_moe" adds 4 experts, top-2, expert width 32 unless overridden).
    """
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    if family == "qwen3_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
    fields.update(overrides)
    config_class = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**fields)).eval()
    with torch.no_grad():  # random, non-trivial norms and biases so every tensor matters
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):  # a router far from uniform: top-k choices are clear-cut
                param.normal_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    return model


def torch_logits(model, ids) -> Any:
    import numpy as np
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.float().numpy()


def run_with_fake_devices(module: str, timeout: int, devices: int = 8) -> Any:
    """Runs ``python -m module`` with ``devices`` fake CPU devices and returns the finished process.

    The device count must be set before jax starts, hence a fresh interpreter; a failure shows its output.
    """
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=fake_cpu_devices(devices), JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", module], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def abstract_like(tree: Any) -> Any:
    """A checkpoint restore target from concrete arrays: same shapes, dtypes and shardings, no memory held."""
    import jax  # a test helper module that most tests import without needing jax
    import numpy as np  # beside jax, for the same reason

    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
            if isinstance(x, jax.Array | np.ndarray)
            else x
        ),
        tree,
    )


def one_line_error(capsys, *args) -> str:
    """The one ``error: ...`` line the main job prints, exiting 2, for a config mistake in ``args``."""
    code = train_main(["trace_jax.train", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == ExitCode.CONFIG and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one .safetensors file, memory-mapped: a reader written apart from
    ``trace_jax.checkpoint.ranged``, so the tests can check that one against it."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        dtype = ST_DTYPES[entry["dtype"]]
        flat = np.memmap(
            path, dtype=dtype, mode="r", offset=8 + header_len + start, shape=((end - start) // dtype.itemsize,)
        )
        tensors[name] = flat.reshape(entry["shape"])
    return tensors
