"""Work placed by slice: each process belongs to one slice (from its devices' ``slice_index``), so the trees it
samples and the engine it decodes on stay in that slice. Fake device records: no accelerator, no libtpu."""

import re
import types

import pytest

from trace_jax.cluster.sharded_rollouts import owner
from trace_jax.parallel import slices


def _devices(processes_per_slice: int, slice_count: int, per_process: int = 4) -> list[types.SimpleNamespace]:
    """Devices of ``slice_count`` slices whose processes are numbered interleaved (process p in slice p % S),
    as a job's process numbering need not follow the slices."""
    out = []
    for process in range(processes_per_slice * slice_count):
        for _ in range(per_process):
            out.append(types.SimpleNamespace(id=len(out), process_index=process, slice_index=process % slice_count))
    return out


def test_each_process_maps_to_the_slice_of_its_devices():
    devices = _devices(processes_per_slice=2, slice_count=2)
    assert slices.process_slices(devices) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert {d.slice_index for d in slices.process_devices(devices, 3)} == {1}
    mixed = [*devices, types.SimpleNamespace(id=99, process_index=0, slice_index=1)]
    with pytest.raises(ValueError, match=re.escape("processes {0: [0, 1]} hold devices of several slices")):
        slices.process_slices(mixed)
    no_slices = [types.SimpleNamespace(id=i, process_index=i // 2) for i in range(4)]  # CPU devices: one slice
    assert slices.process_slices(no_slices) == {0: 0, 1: 0}


def test_each_slice_samples_its_share_of_the_trees():
    # 2 x v5p-64: 8 hosts a slice. A tree is sampled by its owner process, hence in that process's slice.
    devices = _devices(processes_per_slice=8, slice_count=2)
    of_process = slices.process_slices(devices)
    trees = [types.SimpleNamespace(prompt_index=i) for i in range(256)]
    per_slice = {0: 0, 1: 0}
    for tree in trees:
        per_slice[of_process[owner(tree, count=len(of_process))]] += 1
    assert per_slice == {0: 128, 1: 128}
