"""``engine.expert_dispatch``: the engine's programs run their own expert dispatch while the model (and so the
update) keeps its own; both decode the same tokens, and the decode program holds the chosen one's exchange."""

import dataclasses
import json
import pathlib

import jax
import pytest
from flax import nnx

from tests.helpers import run_with_fake_devices
from tests.models.tpu_topology import tpu_devices
from trace_jax import configs
from trace_jax.configs import ConfigError
from trace_jax.models import PRESETS, ModelConfig, abstract_model
from trace_jax.parallel import mesh as mesh_lib
from trace_jax.rollout.engine.engine import Engine, EngineConfig
from trace_jax.rollout.engine.layout import SamplingLayout

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # float32 weights and cache: the two dispatches sum the same products in another order


@pytest.fixture(scope="module")
def dispatch_run():
    done = run_with_fake_devices("tests.rollout.engine_dispatch_check", timeout=600, devices=4)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_decodes_the_same_tokens_with_its_own_dispatch(dispatch_run):
    """(data 2, expert 2) fake CPU mesh, greedy, 4 slots x 8 tokens: the engine with ``all_to_all`` runs that
    dispatch (its model config says so; its decode program holds an all-to-all, the model's ``gather`` engine's
    does not) and decodes the same tokens with log-probs within ``TOLERANCE``. Mutant caught: the key ignored
    (``EngineConfig.model_config`` returning the policy's config: no all-to-all, dispatch ``gather``)."""
    gather, exchange = dispatch_run[""], dispatch_run["all_to_all"]
    assert gather["model_dispatch"] == "gather" and not gather["all_to_all_in_decode"]
    assert exchange["model_dispatch"] == "all_to_all" and exchange["all_to_all_in_decode"]
    assert len({tuple(t) for t in gather["tokens"]}) > 1, "premise: the slots decode different tokens"
    assert exchange["tokens"] == gather["tokens"]
    for got, want in zip(exchange["logprobs"], gather["logprobs"], strict=True):
        assert got == pytest.approx(want, abs=TOLERANCE)


def test_the_tpu_decode_program_exchanges_rows_all_to_all():
    """The engine's ``generate`` compiled for v5p:2x2x1 (data 2 x expert 2) from this host: with
    ``engine.expert_dispatch="all_to_all"`` it holds all-to-all ops, with the model's ``gather`` none, and the
    engine's weights lie as the model's own dispatch would have them (no reshard at a sync). Mutant caught: the
    key ignored."""
    config = dataclasses.replace(PRESETS["qwen3-moe-tiny"], vocab_size=128, head_dim=128)
    mesh = mesh_lib.make_mesh(fsdp=1, devices=tpu_devices(), data=2, expert=2)
    engines = {
        dispatch: Engine.for_model(
            config,
            EngineConfig(max_slots=4, max_len=64, steps_per_call=2, page_size=16, expert_dispatch=dispatch),
            SamplingLayout(mesh),
        )
        for dispatch in ("", "all_to_all")
    }
    texts = {dispatch: engine.lower_generate().compile().as_text() for dispatch, engine in engines.items()}
    assert texts[""].count(" all-to-all(") == 0
    assert texts["all_to_all"].count(" all-to-all(") > 0
    specs = [
        [
            v.value.spec
            for v in jax.tree.leaves(e.layout.param_shardings(abstract_model(e.model_config)[1]), is_leaf=_var)
        ]
        for e in engines.values()
    ]
    assert any("expert" in str(spec) for spec in specs[0]), "premise: the experts are split over expert"
    assert specs[0] == specs[1]


def _var(x):
    return isinstance(x, nnx.Variable)


def test_a_dense_policy_refuses_an_expert_dispatch_and_a_bad_name_is_named():
    dense = ModelConfig.preset("qwen3-tiny", vocab_size=128)
    with pytest.raises(ValueError, match=r"engine.expert_dispatch='all_to_all'.*dense"):
        Engine.for_model(dense, EngineConfig(max_slots=2, max_len=16, page_size=8, expert_dispatch="all_to_all"))
    with pytest.raises(ValueError, match=r"expert_dispatch='scatter'.*gather"):
        EngineConfig(expert_dispatch="scatter")


def test_the_job_config_takes_the_key_and_names_what_is_wrong_with_it():
    """``--config.engine.expert_dispatch``: taken for a MoE policy, refused naming the fix for a dense one (the
    default job's ``qwen3-tiny``) and for a name that is no dispatch. Mutant caught: ``_dispatch_problems``
    left out of ``validate`` (the dense policy passes the door and fails later, in the engine)."""
    spec = str(ROOT / "configs" / "default.py")
    moe = ["--config.sft.model=qwen3-moe-tiny", "--config.engine.expert_dispatch=all_to_all"]
    assert configs.load(spec, moe).engine.expert_dispatch == "all_to_all"
    with pytest.raises(ConfigError, match=r"sft.model='qwen3-tiny' is dense.*engine.expert_dispatch=''"):
        configs.load(spec, ["--config.engine.expert_dispatch=all_to_all"])
    with pytest.raises(ConfigError, match=r"engine.expert_dispatch.*one of gather, all_to_all"):
        configs.load(spec, ["--config.engine.expert_dispatch=scatter"])
