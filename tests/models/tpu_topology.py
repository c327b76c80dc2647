"""Abstract TPU devices for AOT compiles on a CPU host (libtpu installed), or a pytest skip saying why not."""

import os

import pytest


def tpu_devices(topology: str = "v5p:2x2x1") -> list:
    """The abstract devices of ``topology``; skips the calling test when libtpu is not installed or refuses."""
    # Several test processes on one host: libtpu's lockfile would refuse all but the first.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
    except Exception as error:  # ImportError, or the runtime's error without libtpu
        pytest.skip(f"no TPU compiler here (jax[tpu] / libtpu not installed): {type(error).__name__}: {error}")


MOSAIC = 'custom_call_target="tpu_custom_call"'
