"""The HF port of Qwen3-MoE: per-expert safetensors both ways through KEY_MAP, sharded, and clear errors."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import build_hf_checkpoint, read_safetensors
from trace_jax.checkpoint import hf
from trace_jax.checkpoint.hf import load_hf, write_safetensors
from trace_jax.job.cli import ExitCode
from trace_jax.job.commands import hf_main
from trace_jax.models import MoeConfig


def test_import_export_reload_gives_identical_tensors(tmp_path):
    """Catches a transposed or mis-indexed expert / router tensor, or a layer written to the wrong stack row."""
    original = build_hf_checkpoint(
        tmp_path / "hf", "qwen3_moe", tie_word_embeddings=False, num_hidden_layers=3, mlp_only_layers=[1]
    )
    # Premise: HF stores the experts one tensor per expert, and layer 1 is dense.
    stored = read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in stored and "model.layers.1.mlp.up_proj.weight" in stored
    assert hf_main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == ExitCode.OK
    config, _ = hf.load_orbax(tmp_path / "ckpt")
    assert isinstance(config, MoeConfig) and config.layer_stacks() == {"dense_layers": (1,), "moe_layers": (0, 2)}
    code = hf_main(
        ["export", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"), "--max-shard-bytes", "60000"]
    )
    assert code == ExitCode.OK
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    want, got = original.state_dict(), reloaded.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


def test_expert_rows_of_the_key_map():
    assert hf.ours_to_hf("moe_layers.mlp.gate_proj", 4, 7)[0] == "model.layers.4.mlp.experts.7.gate_proj.weight"
    assert hf.ours_to_hf("moe_layers.mlp.router", 4)[0] == "model.layers.4.mlp.gate.weight"
    # A stack's attention and norms read the shared ``layers.`` rows.
    assert hf.ours_to_hf("moe_layers.attn.q_norm.scale", 2)[0] == "model.layers.2.self_attn.q_norm.weight"
    assert hf.ours_to_hf("dense_layers.mlp.down_proj", 1)[0] == "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="expert index"):
        hf.ours_to_hf("moe_layers.mlp.down_proj", 1)


def test_missing_expert_tensor_is_named(tmp_path):
    build_hf_checkpoint(tmp_path, "qwen3_moe")
    tensors = {k: np.array(v) for k, v in read_safetensors(str(tmp_path / "model.safetensors")).items()}
    tensors.pop("model.layers.1.mlp.experts.2.up_proj.weight")
    write_safetensors(str(tmp_path / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"missing tensors: \['model.layers.1.mlp.experts.2.up_proj.weight'\]"):
        load_hf(tmp_path)
