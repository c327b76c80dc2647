"""What a compiled program sends between slices over the data-center network (DCN), apart from ICI traffic.

Two forms carry cross-slice traffic in a compiled program's HLO text: the TPU compiler lowers a collective over
slices to host transfers handled by the MegaScale runtime (``send`` with ``_xla_megascale_transfer_type``); any
other collective counts as DCN when one of its replica groups holds devices of two slices (device ``p`` of the
program lies in slice ``p // devices_per_slice``: ``trace_jax.parallel.mesh.make_mesh`` orders devices slice by
slice). Bytes are per device per program run; loops multiply by their trip counts (``hlo`` counts them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from trace_jax.plan import hlo

_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
# Bytes on the wire per payload byte for S slices (ring algorithms): a reduction sends its payload twice.
_WIRE = {"ALL_REDUCE": lambda s: 2 * (s - 1) / s, "all-reduce": lambda s: 2 * (s - 1) / s}


@dataclasses.dataclass
class DcnTraffic:
    """Cross-slice transfers of one program: per kind, executions per run and payload bytes per device."""

    slices: int
    by_kind: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    @property
    def count(self) -> float:
        return sum(k["count"] for k in self.by_kind.values())

    @property
    def bytes(self) -> float:
        return sum(k["bytes"] for k in self.by_kind.values())

    @property
    def wire_bytes(self) -> float:
        return sum(k["wire_bytes"] for k in self.by_kind.values())

    def seconds(self, gbps_per_chip: float) -> float:
        """Predicted time of these transfers at ``gbps_per_chip`` of DCN (none overlapped with compute)."""
        return self.wire_bytes * 8 / (gbps_per_chip * 1e9)

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "bytes": self.bytes, "wire_bytes": self.wire_bytes, "by_kind": self.by_kind}


def replica_groups(attrs: str, devices: int) -> list[list[int]] | None:
    """The device groups of a collective's attributes (listed ``{{0,4},{1,5}}`` or iota ``[2,4]<=[8]`` /
    ``[4,2]<=[2,4]T(1,0)``); ``[[0..devices-1]]`` when none are given; None for a form not understood."""
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if listed:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        shape = [int(x) for x in iota.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in iota.group(2).split(","))).reshape(
            [int(x) for x in iota.group(2).split(",")]
        )
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\s*(?:,|$)", attrs)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    if "replica_groups" in attrs and "replica_groups={}" not in attrs:
        return None
    return [list(range(devices))]


def dcn_traffic(text: str, devices: int, slices: int) -> DcnTraffic:
    """The cross-slice transfers of a compiled program's HLO ``text`` over ``devices`` devices in ``slices``
    equal slices (see the module docstring)."""
    out = DcnTraffic(slices)
    if slices <= 1:
        return out
    per_slice = devices // slices
    comps, entry = hlo.parse(text)
    shapes = {
        name: t
        for comp in comps.values()
        for name, t in {**comp.params, **{i.name: i.type for i in comp.instructions}}.items()
    }
    runs, _, _, _ = hlo._runs(comps, entry)
    for name, times in runs.items():
        for ins in comps[name].instructions:
            megascale = _MEGASCALE.search(ins.attrs) if ins.op == "send" else None
            kind = ins.op.removesuffix("-start")
            if megascale:
                kind = megascale.group(1)
                size = hlo.type_bytes(shapes.get(ins.operands[0], "")) if ins.operands else 0
            elif kind in hlo.COLLECTIVES:
                groups = replica_groups(ins.attrs, devices)
                if groups is not None and not any(len({d // per_slice for d in g}) > 1 for g in groups):
                    continue
                size = max(hlo.type_bytes(ins.type), sum(hlo.type_bytes(shapes.get(o, "")) for o in ins.operands))
            else:
                continue
            wire = _WIRE.get(kind, lambda s: (s - 1) / s)(slices) * size
            entry_ = out.by_kind.setdefault(kind, {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0})
            entry_["count"] += times
            entry_["bytes"] += times * size
            entry_["wire_bytes"] += times * wire
    return out
