"""HF checkpoints in a bucket: read by byte range over gs://, each process of a job reading only its share."""

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from tests.gcs_emulator import gcs_emulator
from tests.helpers import build_hf_checkpoint, read_safetensors
from trace_jax import paths
from trace_jax.bench import hf_load
from trace_jax.checkpoint import ranged
from trace_jax.checkpoint.hf import load_hf, write_safetensors


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny Qwen3 (2 layers, width 64) stored in bfloat16, as released checkpoints are."""
    path = tmp_path_factory.mktemp("qwen3_bf16")
    build_hf_checkpoint(path, "qwen3", tie_word_embeddings=False)
    stored = read_safetensors(str(path / "model.safetensors"))
    write_safetensors(str(path / "model.safetensors"), {k: v.astype(ml_dtypes.bfloat16) for k, v in stored.items()})
    return path


def _sum(params) -> float:
    return float(sum(np.asarray(x, np.float64).sum() for x in jax.tree.leaves(params)))


def test_a_bucket_checkpoint_loads_as_the_local_one(bf16_dir):
    with gcs_emulator("bucket") as gcs:
        paths.copy_tree(bf16_dir, gcs.gs("qwen3"))
        files = ranged.CheckpointFiles(gcs.gs("qwen3"))
        assert files.entries["model.embed_tokens.weight"].dtype == np.dtype(ml_dtypes.bfloat16)
        config, remote = load_hf(gcs.gs("qwen3"), files=files)
        total = sum(e.end - e.start for e in files.entries.values())
        assert files.bytes_read == total  # one process, no mesh: every byte once
    _, local = load_hf(bf16_dir)
    assert config.num_layers == 2 and config.hidden_size == 64
    # Against the memory-mapped file (an independent reader): a plain and a transposed, stacked tensor.
    stored = read_safetensors(str(bf16_dir / "model.safetensors"))
    np.testing.assert_array_equal(np.asarray(remote["embed"].value), stored["model.embed_tokens.weight"])
    q_proj = np.asarray(remote["layers"]["attn"]["q_proj"].value)[1]
    np.testing.assert_array_equal(q_proj.reshape(64, -1), stored["model.layers.1.self_attn.q_proj.weight"].T)
    for (path, a), (_, b) in zip(nnx.to_flat_state(remote), nnx.to_flat_state(local), strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value), err_msg=str(path))


def test_each_of_two_processes_reads_half_the_checkpoint_from_a_bucket(bf16_dir):
    _, local = load_hf(bf16_dir)
    with gcs_emulator("bucket") as gcs:
        paths.copy_tree(bf16_dir, gcs.gs("qwen3"))
        reports = hf_load.measure(gcs.gs("qwen3"), "ranged", devices=2, timeout=240)
    assert [r["devices"] for r in reports] == [4, 4]
    for report in reports:
        # Every tensor's row count divides by the 4 devices, so each process reads exactly its 2 devices' rows.
        assert report["bytes_read"] == report["tensor_bytes"] // 2, report
        assert report["param_sum"] == pytest.approx(_sum(local), rel=1e-5)
