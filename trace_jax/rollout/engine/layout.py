"""The sampling layout: how the engine's weights, slots and KV pool lie on the mesh, and the once-per-step
reshard from the training layout.

Training shards every weight's ``embed`` axis over ``fsdp`` (ZeRO-3), which costs an all-gather of each weight
at every use: fine for a train step, ruinous for decoding, which touches every weight once per token. The
sampling layout therefore keeps the logical-axis table of ``trace_jax.parallel.mesh`` but drops ``embed``
from it: weights are split over ``tensor`` along heads / mlp / vocab (Megatron style) and replicated over
``data`` and ``fsdp``; decode slots (the batch) are split over ``data`` and ``fsdp``, and so are the KV
pool's pages, which are also split over ``tensor`` by KV head. ``reshard`` casts the trainer's weights to
the sampling dtype (bf16 by default) and moves them into this layout in one compiled program, once per
policy update (``Engine.set_params``, a program of the engine's set); the trainer's copy is left alone.

Limit (say it plainly): the reference attention path gathers pages through the page table with a plain XLA
gather, and a slot's pages may lie on any shard (forks share prefix pages across slots). So the read all-
gathers one layer's pool over the slot shards and then gathers the shard's own slots (one layer's pool
alive at a time; left to itself the partitioner gathered every slot's window on every chip and summed
them, twice the bytes). On a pod that is a layer's pool over the interconnect per step: a shard-aware page
allocator with a shard-local gather (``shard_map``) or the Pallas paged-attention kernel belongs there; on
one host and on fake CPU devices this layout is exact and tested.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trace_jax.parallel.mesh import logical_sharding

# Logical axes the sampling layout replicates although training splits them.
REPLICATED_FOR_SAMPLING = frozenset({"embed"})

# Logical axes of the engine's device state (see ``trace_jax.rollout.engine.engine.DecodeState``).
STATE_AXES: dict[str, tuple[str | None, ...]] = {
    "k_pages": ("kv_heads", "layers", "batch", "cache_length", "head_dim"),
    "v_pages": ("kv_heads", "layers", "batch", "cache_length", "head_dim"),
    "lengths_b": ("batch",),
    "logits_bv": ("batch", None),
    "hidden_bd": ("batch", None),
    "keys_bk": ("batch", None),
    "sampled_b": ("batch",),
    "turn_tokens_b": ("batch",),
    "turn_limit_b": ("batch",),
    "stop_reason_b": ("batch",),
    "greedy_b": ("batch",),
    "recent_bw": ("batch", None),
    "stops_sw": (None, None),
    "stop_len_s": (None,),
    "eos_e": (None,),
    "bank_logits_rv": ("batch", None),
    "bank_hidden_rd": ("batch", None),
    "k_scales": ("kv_heads", "layers", "batch", "cache_length"),
    "v_scales": ("kv_heads", "layers", "batch", "cache_length"),
}


def sampling_axes(axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """A weight's logical axes with the ones sampling replicates removed."""
    return tuple(None if name in REPLICATED_FOR_SAMPLING else name for name in axes)


@dataclasses.dataclass
class SamplingLayout:
    """The engine's placement on ``mesh`` (see the module docstring)."""

    mesh: Mesh

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_shardings(self, params: nnx.State) -> nnx.State:
        """The sampling ``NamedSharding`` of every weight, from its logical axes."""

        def one(variable: nnx.Variable) -> nnx.Variable:
            shape = variable.value.shape
            axes = getattr(variable, "logical_axes", None) or (None,) * len(shape)
            return variable.replace(logical_sharding(self.mesh, sampling_axes(tuple(axes)), shape))

        return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def state_shardings(self, engine: Any) -> Any:
        """Shardings of the engine's ``DecodeState`` (slots and pages over data/fsdp, KV heads over tensor)."""
        shapes = engine.state_shapes()
        return type(shapes)(
            *(
                None if x is None else logical_sharding(self.mesh, STATE_AXES[name], x.shape)
                for name, x in zip(shapes._fields, shapes, strict=True)
            )
        )
