"""The real recipe (``configs/search_r1.py:tiny``) on a Qwen3-MoE checkpoint saved by transformers, routing
replay on: the same files, tokenizer and BM25 retriever as ``test_search_r1.py``, with a tiny random
``Qwen3MoeForCausalLM`` (4 experts, top-2) in place of the dense checkpoint; one RL step, then the export."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import search_r1_fixtures as fixtures
from tests.helpers import torch_logits
from trace_jax.checkpoint.hf import load_hf
from trace_jax.job import build, recipes
from trace_jax.models import abstract_model

REPO = pathlib.Path(__file__).resolve().parents[2]
# A whole recipe run in a subprocess: 168 CPU-seconds (697 s wall at load ~10 on 2 cores).
pytestmark = pytest.mark.slow


def test_one_rl_step_of_the_recipe_on_a_moe_checkpoint_with_routing_replay_exports_what_transformers_loads(
    tmp_path,
):
    """Catches a recipe path (HF import, engine with routing record, trainer replay, checkpoint, HF export)
    that builds or writes a dense model only: the run must finish, log the sparse layers' load-balancing loss,
    and export a ``Qwen3MoeForCausalLM`` whose logits equal the trained policy's."""
    from transformers import AutoModelForCausalLM

    files = fixtures.write_all(tmp_path / "files", family="qwen3_moe", moe_intermediate_size=16)
    source_config = json.loads((files["hf"] / "config.json").read_text())
    assert source_config["model_type"] == "qwen3_moe"  # premise: transformers wrote a mixture of experts
    workdir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "trace_jax.train",
        f"--config={REPO}/configs/search_r1.py:tiny",
        f"--config.model.hf_dir={files['hf']}",
        f"--config.data.dir={files['data']}",
        "--config.retriever.kind=bm25",
        f"--config.retriever.corpus={files['corpus']}",
        "--config.engine.routing_replay=True",
        "--config.rl.steps=1",
        "--config.eval.num_questions=2",
        "--config.loss.entropy_coef=0.01",  # a gradient even when every reward ties, so the policy moves
        f"--workdir={workdir}",
    ]
    run = subprocess.run(
        command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 1
    config = build.load_run_config(workdir)
    assert config.engine.routing_replay  # premise: the engine recorded routes and the trainer replayed them
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    aux = [r["train/router_aux_loss"] for r in records if "train/router_aux_loss" in r]
    assert aux and all(a > 0 for a in aux)  # the trainer ran the sparse layers (fails on a dense forward)

    start, params, source = recipes.latest_policy(config, workdir)
    assert source == "rl step 1"
    moe_leaves = [p for p, _ in jax.tree_util.tree_leaves_with_path(params) if "moe_layers" in str(p)]
    assert moe_leaves  # the policy trained is the mixture of experts
    _, initial = load_hf(files["hf"])
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    assert moved > 1e-6  # premise: the export below is the trained policy, not the input checkpoint

    summary = json.loads((workdir / "summary.json").read_text())
    export = pathlib.Path(summary["exports"][recipes.EXPORT_DIR])
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    ids = np.asarray([start.world.env.prompt_ids(start.world.world.questions("test")[0])])
    ours = np.asarray(nnx.merge(abstract_model(start.model_config)[0], params)(jnp.asarray(ids))[0])
    theirs = torch_logits(AutoModelForCausalLM.from_pretrained(export).eval(), ids)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
