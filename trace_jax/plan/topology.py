"""Accelerator topologies the planner knows: chips per slice name and memory per chip (no jax import)."""

from __future__ import annotations

import dataclasses
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Family:
    """One accelerator generation: memory per chip and how a slice name's number counts chips."""

    name: str
    memory_bytes: int
    cores_per_chip: int  # TPU v4 / v5p names count TensorCores (2 per chip); v5e / v6e and GPUs count chips
    note: str


# Public figures: HBM per chip (TPU v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB; H100 80 GB, H200 141 GB).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("v4", 32 * GIB, 2, "TPU v4: v4-N has N TensorCores, N/2 chips"),
        Family("v5e", 16 * GIB, 1, "TPU v5e (v5litepod-N): N chips"),
        Family("v5p", 95 * GIB, 2, "TPU v5p: v5p-N has N TensorCores, N/2 chips"),
        Family("v6e", 32 * GIB, 1, "TPU v6e (Trillium): N chips"),
        Family("h100", 80 * 10**9, 1, "NVIDIA H100 80 GB: h100-N is N GPUs"),
        Family("h200", 141 * 10**9, 1, "NVIDIA H200 141 GB: h200-N is N GPUs"),
    )
}
_ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    family: Family
    chips: int

    @property
    def memory_bytes(self) -> int:
        return self.family.memory_bytes


def parse_topology(name: str) -> Topology:
    """``v5p-64`` -> 32 chips of 95 GiB; ``v5e-64`` / ``v5litepod-64`` -> 64 chips of 16 GiB; ``h100-8``."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.lower())
    family = _ALIASES.get(match.group(1), match.group(1)) if match else None
    if family not in FAMILIES:
        known = ", ".join(f"{f}-N" for f in FAMILIES)
        raise ValueError(f"unknown topology {name!r}; use one of {known} (e.g. v5p-64)")
    fam, count = FAMILIES[family], int(match.group(2))
    if count % fam.cores_per_chip or count == 0:
        raise ValueError(f"topology {name!r}: {fam.note}; {count} is not a whole number of chips")
    return Topology(name, fam, count // fam.cores_per_chip)
