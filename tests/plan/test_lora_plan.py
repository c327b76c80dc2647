"""The planner's LoRA job: the abstract train state and the compiled update are the job's (adapters trained,
the base frozen), and the ``--lora-*`` options are checked."""

import math
import os
import re

import jax
import jax.numpy as jnp
import pytest

from trace_jax.models import ModelConfig, lora
from trace_jax.parallel.mesh import make_mesh
from trace_jax.plan import lora as plan_lora
from trace_jax.plan import lora_fits, remake
from trace_jax.plan.compile import abstract_batch, abstract_train_state, shard_bytes
from trace_jax.plan.timing import matmul_params, model_flops_per_token
from trace_jax.rl.losses import LossConfig
from trace_jax.rl.trainer import RLTrainer, UpdateConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ModelConfig.preset(
    "qwen3-tiny",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    vocab_size=128,
)


def _returned_unchanged(compiled_text: str) -> set[str]:
    """The entry parameters a compiled program returns as they came in (operands of its ROOT tuple)."""
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    params = set(re.findall(r"%?([\w.\-]+) = [^ ]+ parameter\(", entry))
    root = next(line for line in entry.splitlines() if line.lstrip().startswith("ROOT"))
    operands = root[root.rindex(" tuple(") :]
    return {name for name in re.findall(r"%([\w.\-]+)", operands) if name in params}


@pytest.mark.parametrize("base_quant", ["none", "int8"])
def test_a_lora_plan_trains_the_adapters_alone_and_apply_passes_the_base_through(base_quant):
    config = plan_lora.adapted(TINY, 4, 8.0, "q,k,v,o,gate,up,down", base_quant)
    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, state, optimizer = abstract_train_state(config, mesh)
    adapters = lora.adapter_state(state.params)
    parts = plan_lora.param_parts(state.params)
    adapter_bytes, base_bytes = shard_bytes(adapters), shard_bytes(parts["weights"])
    assert 0 < 3 * adapter_bytes < base_bytes  # the premise: a base much bigger than its adapters
    int8 = [x for x in jax.tree.leaves(parts["weights"]) if x.dtype == jnp.int8]
    assert len(int8) == (7 if base_quant == "int8" else 0)  # QLoRA: the 7 projections (stacked over layers) in int8

    # AdamW's two moments of the adapters alone (plus its step count).
    assert 2 * adapter_bytes <= shard_bytes(state.opt_state) <= 2 * adapter_bytes + 16
    trainer = RLTrainer(graphdef, optimizer, LossConfig(), mesh=mesh, update=UpdateConfig(micro_rows=1))
    micro = abstract_batch(1, 64, mesh, with_ref=False)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = trainer.lower_update(state, micro)
    # The gradient accumulator the update carries between micro-batches is shaped as the adapters.
    _, grads, _ = lowered["accumulate"].out_info
    assert jax.tree.map(lambda x: (x.shape, x.dtype), grads) == jax.tree.map(lambda x: (x.shape, x.dtype), adapters)

    # apply: every base weight is an argument returned as it came in; every adapter is computed anew.
    apply_text = lowered["apply"].compile().as_text()
    unchanged = _returned_unchanged(apply_text)
    base_names = {n for n in re.findall(r"(state_params__[\w.]+): ", apply_text) if "_lora_" not in n}
    adapter_names = {n for n in re.findall(r"(state_params__[\w.]+): ", apply_text) if "_lora_" in n}
    assert len(base_names) == len(jax.tree.leaves(parts["weights"]))
    assert len(adapter_names) == len(jax.tree.leaves(adapters))
    assert base_names <= unchanged
    assert not adapter_names & unchanged

    # A frozen base computes no weight gradient: the model FLOPs of a token lose 2 x params, gain 6 x adapters.
    values = sum(math.prod(x.shape) for x in jax.tree.leaves(adapters))
    assert plan_lora.train_flops_per_token(config, 32) == pytest.approx(
        model_flops_per_token(TINY, 32) - 2 * matmul_params(TINY) + 6 * values
    )


def test_the_lora_options_name_what_is_wrong():
    with pytest.raises(SystemExit, match=r"--lora-rank/--lora-targets/--lora-base-quant: .*\['qkv'\]"):
        plan_lora.adapted(TINY, 8, 16.0, "qkv")
    with pytest.raises(SystemExit, match=r"int4.* is refused"):
        plan_lora.adapted(TINY, 8, 16.0, "q", "int4")
    with pytest.raises(SystemExit, match=r"--lora-base-quant int8 .* set --lora-rank"):
        plan_lora.adapted(TINY, 0, 16.0, "q", "int8")
    assert plan_lora.adapted(TINY, 0, 16.0, "q") is TINY


def test_a_fits_table_cell_may_not_fit_but_must_have_compiled_the_update():
    refused = {"train": {"fits": None, "tried": [{"program": "update", "error": "RESOURCE_EXHAUSTED"}]}}
    assert remake.check(refused, "fit") == []
    assert remake.check({"train": {"fits": None, "tried": []}}, "fit") == [
        "no update compiled (the row's command must compile it)"
    ]
    fitting = {"train": {"fits": {"program": "update"}, "tried": [{}]}, "timing": {}}
    assert remake.check(fitting, "fit") == ["no update timing"]


def test_the_lora_page_quotes_each_committed_fits_cell_as_its_plan_reads():
    """Mutant caught: the MFU printed with another rounding (`:.0%`)."""
    with open(os.path.join(ROOT, "docs", "lora.md")) as f:
        page = f.read()
    found = lora_fits.lines()
    assert found, "no fits-table plan committed"
    for row, text in found.items():
        assert text in page, f"{row}: run python -m trace_jax.plan.lora_fits and paste its line into docs/lora.md"
