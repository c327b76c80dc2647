import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trace_jax.checkpoint.state import StateCheckpointer
from trace_jax.optim import make_optimizer


def _train_state(seed: int):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
    _, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(learning_rate=0.1, warmup_steps=1, total_steps=10)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial moments and count
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key(seed),
        "step": jnp.asarray(seed, jnp.int32),
        "predictor": None,
    }


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_roundtrip_whole_state_with_metadata(tmp_path):
    ckpt = StateCheckpointer(tmp_path, save_every=1, keep=2)
    state = _train_state(3)
    ckpt.save(7, state, metadata={"data_iterator": {"index": 12}, "scheduler": [1, 2]})
    target = _train_state(0)  # same structure, different values
    restored = StateCheckpointer(tmp_path).restore_latest(target=target)
    assert restored.step == 7
    assert restored.metadata == {"data_iterator": {"index": 12}, "scheduler": [1, 2]}
    assert isinstance(restored.state["params"], nnx.State)
    assert restored.state["predictor"] is None
    assert jax.dtypes.issubdtype(restored.state["rng"].dtype, jax.dtypes.prng_key)
    _assert_same(
        {k: v for k, v in restored.state.items() if v is not None}, {k: v for k, v in state.items() if v is not None}
    )
    # The restored rng continues the same random stream.
    np.testing.assert_array_equal(jax.random.normal(restored.state["rng"], (3,)), jax.random.normal(state["rng"], (3,)))


def test_save_every_and_keep(tmp_path):
    ckpt = StateCheckpointer(tmp_path, save_every=2, keep=2)
    written = [ckpt.save(step, {"x": jnp.full((2,), step)}) for step in range(1, 8)]
    assert written == [False, True, False, True, False, True, False]
    assert ckpt.all_steps() == [4, 6]
    assert ckpt.save(7, {"x": jnp.zeros(2)}, force=True)
    assert ckpt.latest_step() == 7
    assert not ckpt.save(7, {"x": jnp.ones(2)}, force=True)  # already there: kept as it was
    np.testing.assert_array_equal(ckpt.restore(7).state["x"], np.zeros(2))


def test_nothing_saved_gives_none(tmp_path):
    assert StateCheckpointer(tmp_path).restore_latest() is None


def _corrupt(step_dir, how):
    files = sorted(p for p in (step_dir / "params").rglob("*") if p.is_file() and p.stat().st_size > 0)
    assert files, f"no files under {step_dir}"
    if how == "truncate":
        for path in files:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    else:
        shutil.rmtree(step_dir / "params")


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path, how):
    ckpt = StateCheckpointer(tmp_path, keep=3)
    for step in (1, 2):
        ckpt.save(step, _train_state(step))
    _corrupt(tmp_path / "2", how)
    with pytest.warns(RuntimeWarning, match="step 2"):
        restored = StateCheckpointer(tmp_path).restore_latest(target=_train_state(0))
    assert restored.step == 1
    _assert_same(restored.state["params"], _train_state(1)["params"])


def test_interrupted_save_is_ignored(tmp_path):
    ckpt = StateCheckpointer(tmp_path)
    ckpt.save(1, _train_state(1))
    # What a kill during a save leaves behind: an unfinished temporary step directory.
    shutil.copytree(tmp_path / "1", tmp_path / "2.orbax-checkpoint-tmp-123")
    reopened = StateCheckpointer(tmp_path)
    assert reopened.all_steps() == [1]
    assert reopened.restore_latest(target=_train_state(0)).step == 1


def test_restore_into_target_shardings_and_subset(tmp_path):
    ckpt = StateCheckpointer(tmp_path)
    state = _train_state(5)
    ckpt.save(1, state)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.update(spec=(None, "model")[-x.ndim :])),
        state["params"],
    )
    restored = ckpt.restore_latest(target={"params": abstract})
    assert set(restored.state) == {"params"}
    assert restored.state["params"]["kernel"].value.sharding == sharding
    _assert_same(restored.state["params"], state["params"])
    with pytest.raises(KeyError, match="no entries"):
        ckpt.restore(1, keys=["predictor_params"])


_SAVER = """
import sys
import jax.numpy as jnp
from trace_jax.checkpoint.state import StateCheckpointer

ckpt = StateCheckpointer(sys.argv[1], keep=2, async_save=True)
for step in range(1, 10_000):
    ckpt.save(step, {"w": jnp.full((128, 512), float(step)), "step": jnp.asarray(step)}, metadata={"seen": step})
    print(step, flush=True)
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_at_a_random_moment_resumes_from_a_complete_checkpoint(tmp_path, seed):
    rng = np.random.default_rng(seed)
    child = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        kill_after = int(rng.integers(3, 8))
        for line in child.stdout:
            if int(line) >= kill_after:
                break
        time.sleep(float(rng.uniform(0, 0.05)))  # land anywhere, including in the middle of a save
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    target = {"w": jnp.zeros((128, 512)), "step": jnp.asarray(0)}
    restored = StateCheckpointer(tmp_path).restore_latest(target=target)
    assert restored.step >= kill_after - 1
    np.testing.assert_array_equal(restored.state["w"], np.full((128, 512), float(restored.step)))
    assert int(restored.state["step"]) == restored.step and restored.metadata == {"seen": restored.step}


def test_a_bucket_url_stays_a_url_through_orbax_and_restores(tmp_path, monkeypatch):
    from tests.fake_gcs import fake_gcs

    monkeypatch.chdir(tmp_path)  # where pathlib's "gs:/bucket/..." would have landed
    state = _train_state(4)
    with fake_gcs(tmp_path / "gcs") as bucket_root:
        ckpt = StateCheckpointer("gs://bucket/run/checkpoints", keep=2)
        assert str(ckpt.directory) == "gs://bucket/run/checkpoints"
        for step in (1, 2, 3):
            ckpt.save(step, state, metadata={"step": step})
        ckpt.close()
        restored = StateCheckpointer("gs://bucket/run/checkpoints").restore_latest(target=_train_state(0))
    assert restored.step == 3 and restored.metadata == {"step": 3}
    _assert_same(restored.state["params"], state["params"])
    steps = sorted(p.name for p in (bucket_root / "bucket" / "run" / "checkpoints").iterdir())
    assert steps == ["2", "3"]  # keep=2 deleted step 1 in the bucket too
    assert not (tmp_path / "gs:").exists()


class _PerLayerQwen(nnx.Module):
    """The decoder's parameter layout before layers were stacked: ``layers`` an nnx.List of DecoderLayer."""

    def __init__(self, config, rngs):
        from trace_jax.models.qwen import DecoderLayer, RMSNorm

        self.embed = nnx.Param(jax.random.normal(rngs.params(), (config.vocab_size, config.hidden_size)))
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config, config.hidden_size, "embed")


def test_old_per_layer_checkpoint_restores_into_the_stacked_model(tmp_path):
    from trace_jax.models import ModelConfig, Qwen

    config = ModelConfig.preset("qwen3-tiny")
    _, old_params = nnx.split(_PerLayerQwen(config, nnx.Rngs(1)), nnx.Param)
    tx = make_optimizer(learning_rate=0.1)
    _, old_opt = tx.update(jax.tree.map(jnp.ones_like, old_params), tx.init(old_params), old_params)
    StateCheckpointer(tmp_path).save(3, {"params": old_params, "opt_state": old_opt}, force=True)

    _, params = nnx.split(Qwen(config, rngs=nnx.Rngs(0)), nnx.Param)
    opt = tx.init(params)
    restored = StateCheckpointer(tmp_path).restore_latest(target={"params": params, "opt_state": opt}).state

    assert jax.tree.structure(restored["params"]) == jax.tree.structure(params)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(opt)
    np.testing.assert_array_equal(restored["params"]["embed"].value, old_params["embed"].value)
    # Premise: the layers differ from each other, so row i must come from old layer i.
    q_old = [np.asarray(old_params["layers"][i]["attn"]["q_proj"].value) for i in range(config.num_layers)]
    assert not np.array_equal(q_old[0], q_old[1])
    for new_tree, old_tree in ((restored["params"], old_params), (restored["opt_state"][1][0].mu, old_opt[1][0].mu)):
        old_rows = [jax.tree.leaves(old_tree["layers"][i]) for i in range(config.num_layers)]
        for j, stacked in enumerate(jax.tree.leaves(new_tree["layers"])):
            assert stacked.shape[0] == config.num_layers
            for i in range(config.num_layers):
                np.testing.assert_array_equal(np.asarray(stacked[i]), np.asarray(old_rows[i][j]))
    # The restored params drive the stacked model.
    model = nnx.merge(nnx.split(Qwen(config, rngs=nnx.Rngs(0)), nnx.Param)[0], restored["params"])
    assert np.isfinite(np.asarray(model(jnp.zeros((1, 4), jnp.int32)).logits_btv)).all()
