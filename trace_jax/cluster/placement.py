"""Where a run's work lies: the devices that train and the ones that sample (``mesh.rollout_devices``).

Colocated (``rollout_devices = 0``, the default): the engine decodes on the training mesh (with several processes,
each process's engine on its own devices, ``Processes.sampling_mesh``). Apart (``rollout_devices = n``): the first
n devices of ``jax.devices()`` only sample, the rest only train. The engine keeps its own sampling-layout copy
of the weights on its devices (``trace_jax.rollout.engine.layout``); after each update :meth:`Placement.to_engine`
sends the trainer's weights there with one device-to-device transfer (``jax.device_put`` into the sampling
layout's shardings), and the engine's reshard program casts them on its own devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from trace_jax.configs.sections import MeshConfig
from trace_jax.parallel.mesh import MESH_AXES, make_mesh, split_devices


@dataclasses.dataclass(frozen=True)
class Placement:
    """The training mesh, and the sampling mesh when sampling has devices of its own (``None``: colocated)."""

    train_mesh: Mesh
    sampling_mesh: Mesh | None = None

    @classmethod
    def of(cls, mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Placement:
        """The placement a run's ``mesh`` section asks for on ``devices`` (default: all of them). The sampling
        devices split the engine's slots over ``fsdp`` and its weights over ``tensor`` as training does, when
        the training ``tensor`` size divides them."""
        axes = {axis: getattr(mesh_config, axis) for axis in MESH_AXES}
        sampling, training = split_devices(jax.devices() if devices is None else devices, mesh_config.rollout_devices)
        train_mesh = make_mesh(**axes, devices=training, slices=mesh_config.slices)
        if not sampling:
            return cls(train_mesh)
        tensor = train_mesh.shape["tensor"]
        tensor = tensor if len(sampling) % tensor == 0 else 1
        return cls(train_mesh, make_mesh(data=1, fsdp=-1, tensor=tensor, devices=sampling))

    @property
    def apart(self) -> bool:
        """Whether sampling and training run on disjoint devices."""
        return self.sampling_mesh is not None

    def engine_mesh(self, colocated: Mesh) -> Mesh:
        """The mesh the engine decodes on: the sampling devices, or ``colocated`` (the processes' choice)."""
        return self.sampling_mesh if self.apart else colocated

    def to_engine(self, weights: Any, layout: Any) -> Any:
        """``weights`` on the engine's devices in its sampling layout (``layout``: a ``SamplingLayout``); left
        as they are when colocated (the engine's reshard program moves them itself)."""
        if not self.apart:
            return weights
        return jax.device_put(weights, layout.param_shardings(weights))

    def describe(self) -> dict[str, Any]:
        """Facts for a run's summary: which devices train and which sample."""
        ids = lambda mesh: [device.id for device in mesh.devices.flat]
        sampling = ids(self.sampling_mesh) if self.apart else "training devices"
        return {"training_devices": ids(self.train_mesh), "sampling_devices": sampling}
