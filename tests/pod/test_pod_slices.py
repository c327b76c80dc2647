"""``launch/tpu_pod.sh --slices 2`` against the pod in a box, checked dry of training: one queued-resource request
makes both slices, the code reaches every host of each, and each slice's start carries its own MegaScale variables
with slice 0's worker 0 as the coordinator. The box cannot join slices over DCN (the MegaScale runtime is the TPU's),
so the jobs it starts are stopped, not run."""

from __future__ import annotations

import subprocess

from tests.pod import fake_gcloud
from tests.pod.journeys import ROOT, make_box

TPU = "box-m"


def test_two_slices_come_from_one_request_get_the_code_and_each_its_megascale_variables(tmp_path):
    """Fails if the launcher asks for the slices one by one, ships to one slice only, or starts every slice with
    the same (or no) MegaScale identity."""
    box = make_box(tmp_path)
    command = ["bash", str(ROOT / "launch" / "tpu_pod.sh"), "--tpu", TPU, "--zone", "box-a", "--accelerator", "v5p-8"]
    command += [
        "--workdir",
        "gs://bucket/run",
        "--slices",
        "2",
        "--skip-plan",
        "--no-stream",
        "--",
        "--config.rl.steps=1",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=box.env)
        calls = fake_gcloud.calls(box.root)
        worker_scripts = {  # per slice, per host: whether the shipped code is there
            node: [(h / "trace_jax_run" / "code" / "launch" / "tpu_worker.sh").is_file() for h in hosts]
            for node in (f"{TPU}-0", f"{TPU}-1")
            for hosts in [fake_gcloud.host_dirs(box.root, node)]
        }
    finally:
        if fake_gcloud._meta(box.root, TPU):
            fake_gcloud.delete(box.root, TPU)  # the request and its slices; kills the jobs started there
    assert done.returncode == 0, done.stderr[-3000:]
    creates = [c for c in calls if c[3] == "create"]
    assert len(creates) == 1 and creates[0][2] == "queued-resources", creates
    assert "--node-count=2" in creates[0] and f"--node-prefix={TPU}" in creates[0]
    for slice_id, (node, shipped) in enumerate(worker_scripts.items()):
        assert shipped == [True, True], node
        starts = [c for c in calls if c[3:5] == ["ssh", node] and " start " in c[-1]]
        assert len(starts) == 1, (node, starts)
        assert "--worker=all" in starts[0]
        assert f"MEGASCALE_SLICE_ID={slice_id}" in starts[0][-1] and "MEGASCALE_NUM_SLICES=2" in starts[0][-1]
        assert "MEGASCALE_COORDINATOR_ADDRESS=127.0.0.1:8080" in starts[0][-1]
        assert "--config.mesh.slices=2" in starts[0][-1]
    assert not (box.root / "slices").exists() or not list((box.root / "slices").iterdir()), (
        "the request took its slices"
    )
