"""Accelerator topologies the planner knows: chips per slice name, memory per chip, and the name libtpu
gives the same slice (no jax import)."""

from __future__ import annotations

import dataclasses
import math
import re

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Family:
    """One accelerator generation: memory per chip, how a slice name's number counts chips, and (TPUs) the
    generation's name in libtpu's topology names and the rank of its chip grid (2D or 3D torus)."""

    name: str
    memory_bytes: int
    cores_per_chip: int  # TPU v4 / v5p names count TensorCores (2 per chip); v5e / v6e and GPUs count chips
    note: str
    libtpu: str | None = None  # e.g. "v5p" in "v5p:2x4x4"; None: not a TPU
    grid_rank: int = 0
    dcn_gbps_per_chip: float | None = None  # data-center network between slices, per chip (None: not stated)


# Public figures: HBM per chip (TPU v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB; H100 80 GB, H200 141 GB).
# DCN per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v5p, /v5e, /v6e): v5p states
# 50 Gbps per chip; v5e 2 x 100 Gbps NICs per 8-chip host (25 per chip); v6e 4 x 200 Gbps per 8-chip host (100).
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("v4", 32 * GIB, 2, "TPU v4: v4-N has N TensorCores, N/2 chips", "v4", 3),
        Family("v5e", 16 * GIB, 1, "TPU v5e (v5litepod-N): N chips", "v5e", 2, 25.0),
        Family("v5p", 95 * GIB, 2, "TPU v5p: v5p-N has N TensorCores, N/2 chips", "v5p", 3, 50.0),
        Family("v6e", 32 * GIB, 1, "TPU v6e (Trillium): N chips", "v6e", 2, 100.0),
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
    grid: tuple[int, ...] | None = None  # the chip grid, for a TPU (libtpu's AxBxC)

    @property
    def memory_bytes(self) -> int:
        return self.family.memory_bytes

    @property
    def is_tpu(self) -> bool:
        return self.family.libtpu is not None

    @property
    def libtpu_name(self) -> str:
        """The slice as ``jax.experimental.topologies.get_topology_desc`` names it, e.g. ``v5p:2x4x4``."""
        if self.grid is None:
            raise ValueError(f"{self.name} is not a TPU slice: the TPU compiler cannot target it")
        return f"{self.family.libtpu}:{'x'.join(map(str, self.grid))}"


def chip_grid(family: Family, chips: int) -> tuple[int, ...]:
    """The chip grid of a slice of ``chips`` chips, as Google's slice tables list them: 3D families from
    2x2x1 (4 chips), 2D ones from 1x1, doubling the smallest side (the last of equals) each time: v5p-64
    (32 chips) is 2x4x4, v5p-256 4x4x8, v6e-64 8x8, v5e-16 4x4."""
    if chips & (chips - 1) or chips < 1 or (family.grid_rank == 3 and chips < 4):
        smallest = 4 if family.grid_rank == 3 else 1
        raise ValueError(
            f"{family.name}: {chips} chips is not a slice the planner knows (a power of two, at least {smallest})"
        )
    grid = [2, 2, 1] if family.grid_rank == 3 else [1] * family.grid_rank
    while math.prod(grid) < chips:
        smallest = min(grid)
        i = max(j for j, g in enumerate(grid) if g == smallest)
        grid[i] *= 2
    return tuple(grid)


def _known() -> str:
    tpus = [f"{f.name}-N" for f in FAMILIES.values()] + [f"{f.libtpu}:AxB[xC]" for f in FAMILIES.values() if f.libtpu]
    return ", ".join(tpus) + " (e.g. v5p-64, v6e-64, v5e-16, v4-32, v5p:2x4x4, h100-8)"


def parse_topology(name: str) -> Topology:
    """``v5p-64`` -> 32 chips of 95 GiB (grid 2x4x4); ``v5e-64`` / ``v5litepod-64`` -> 64 chips of 16 GiB;
    libtpu's own names too (``v5p:2x4x4``, ``v6e:8x8``); ``h100-8``. Unknown names raise a ValueError that
    lists the accepted forms."""
    lowered = name.lower()
    grid_match = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", lowered)
    if grid_match:
        family = _ALIASES.get(grid_match.group(1), grid_match.group(1))
        fam = next((f for f in FAMILIES.values() if f.libtpu == family), None)
        grid = tuple(int(g) for g in grid_match.group(2).split("x"))
        if fam is None or len(grid) != fam.grid_rank or 0 in grid:
            raise ValueError(f"unknown topology {name!r}; use one of {_known()}")
        return Topology(name, fam, math.prod(grid), grid)
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", lowered)
    family = _ALIASES.get(match.group(1), match.group(1)) if match else None
    if family not in FAMILIES:
        raise ValueError(f"unknown topology {name!r}; use one of {_known()}")
    fam, count = FAMILIES[family], int(match.group(2))
    if count % fam.cores_per_chip or count == 0:
        raise ValueError(f"topology {name!r}: {fam.note}; {count} is not a whole number of chips")
    chips = count // fam.cores_per_chip
    grid = None
    if fam.libtpu is not None:
        try:
            grid = chip_grid(fam, chips)
        except ValueError:
            grid = None  # still plannable on XLA:CPU stand-ins; the TPU compiler needs a known grid
    return Topology(name, fam, chips, grid)
