"""Journey (a) with the real recipe, from the README's first step: the README's own ``gcloud storage`` commands
(step 1, through the fake ``gcloud``, ``tests/pod/fake_gcloud.py``) make the bucket on the GCS emulator and copy a
tiny Qwen3 HF directory, Search-R1 parquet / jsonl question files and a corpus into it (``tests/search_r1_fixtures.py``,
renamed as the README names them); the README's retrieval server (step 2) serves the corpus from the bucket as a
process of its own; ``launch/tpu_pod.sh --create --watch`` on the 2-host pod in a box (``tests/pod/journeys.py``)
runs ``configs/search_r1.py:tiny`` with the README's job overrides (checkpoint and data from the bucket, the
retriever at the server's URL) and the workdir in the bucket: nothing is copied onto a host. One RL step; the export
lands in the bucket, where transformers loads it."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
import subprocess
import sys
import time

import numpy as np
from etils import epath

from tests import search_r1_fixtures as fixtures
from tests.gcs_emulator import gcs_emulator
from tests.helpers import torch_logits
from tests.pod import fake_gcloud
from tests.pod.journeys import HEARTBEAT_TIMEOUT_S, ROOT, Launch, host_log, launch_command, make_box
from trace_jax import paths
from trace_jax.data.tokenizer import load_tokenizer
from trace_jax.job import recipes

TPU = "box-r1"
SEARCHED = re.compile(r"POST /retrieve 200 queries=[1-9]")  # the server's access-log line of an answered search


def pod_walkthrough() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## TPU pods and several processes") :].split("\n## ", 1)[0]


def step_1_commands(walkthrough: str) -> str:
    """Step 1's bash block: the variables, ``gcloud storage buckets create`` and ``gcloud storage cp -r``."""
    block = re.search(r"```bash\n(.*?)```", walkthrough[walkthrough.index("1. **") :], re.S).group(1)
    assert "gcloud storage buckets create" in block and "gcloud storage cp -r" in block, block
    return block


def step_2_server(walkthrough: str) -> str:
    """Step 2's server command line."""
    return re.search(r"`(python -m trace_jax\.envs\.retrieval serve [^`]+)`", walkthrough).group(1)


def step_4_overrides(walkthrough: str) -> list[str]:
    """The job's overrides of step 4's launch line (after its ``--``)."""
    start = walkthrough.index("launch/tpu_pod.sh --dry-run")
    words = shlex.split(walkthrough[start:].split("```", 1)[0].replace("\\\n", " "))
    return words[words.index("--") + 1 :]


def serve(command: str, log: pathlib.Path, timeout_s: float = 120) -> subprocess.Popen:
    """Starts the server and waits for its ``serving ... on http://...`` line (``envs/retrieval/__main__.py``)."""
    words = shlex.split(command)
    assert words[:1] == ["python"], words
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, *words[1:]], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while "serving " not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "serving " in log.read_text(), log.read_text()[-3000:]
    return server


def test_a_the_search_r1_recipe_runs_from_the_readmes_bucket_and_server_on_every_host_and_exports_there(tmp_path):
    """Fails when the README's step 1 does not put the inputs where its launch line reads them (the fake
    ``gcloud storage cp -r`` without each source's basename: no ``Qwen3-8B/`` in the bucket), when the job does not
    search through the README's server (a server stopped before the launch: no answered search in its log), on any
    host that reads an input as a local path (the hosts' folders hold none of them), and on an export that does
    not reach the bucket or that transformers cannot load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    walkthrough = pod_walkthrough()
    files = fixtures.write_all(tmp_path / "files")
    local = tmp_path / "path" / "to"  # the README's /path/to/, holding the fixture's files under its names
    local.mkdir(parents=True)
    for name, readme_name in (("hf", "Qwen3-8B"), ("data", "search_r1"), ("corpus", "wiki-18.jsonl")):
        files[name].rename(local / readme_name)
    box = make_box(tmp_path)
    with gcs_emulator("bucket") as gcs:
        step_1 = step_1_commands(walkthrough).replace("/path/to/", f"{local}/")
        made = subprocess.run(["bash", "-ec", step_1], env={**box.env, **gcs.env}, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        bucket = re.search(r"\bBUCKET=(\S+)", step_1).group(1)
        emulated = dataclasses.replace(gcs, bucket=bucket)
        copied = set(emulated.names(""))
        assert {"Qwen3-8B/config.json", "search_r1/train.parquet", "wiki-18.jsonl"} <= copied, sorted(copied)

        port = fake_gcloud.free_port()
        server_command = step_2_server(walkthrough).replace("$BUCKET", bucket).replace("0.0.0.0", "127.0.0.1")
        server_command = server_command.replace("--port 8000", f"--port {port}")
        server_log = tmp_path / "server.log"
        server = serve(server_command, server_log)
        try:
            job_env = {**gcs.env, "JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
            readme_flags = [
                re.sub(r"http://[^/]+:8000", f"http://127.0.0.1:{port}", flag).replace("$BUCKET", bucket)
                for flag in step_4_overrides(walkthrough)
            ]
            assert f"--config.retriever.url=http://127.0.0.1:{port}" in readme_flags, readme_flags
            flags = [
                *readme_flags,
                "--config.rl.steps=1",
                "--config.eval.num_questions=2",
                f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
            ]
            workdir = f"gs://{bucket}/runs/tiny"
            command = launch_command(TPU, workdir, job_env, *flags, config="configs/search_r1.py:tiny")
            try:
                code, output = Launch(box, command, tmp_path / "launch.log").finish(timeout_s=900)
                host_1 = host_log(box, TPU, 1)
            finally:
                fake_gcloud.delete(box.root, TPU)  # kills whatever still runs there
        finally:
            server.terminate()
            server.wait(timeout=30)
        assert code == 0, output[-3000:] + "\nhost 1:\n" + host_1[-3000:]
        assert "watch: the job finished (exit status 0)" in output
        assert "connected to 1 peer ranks" in output, "premise: the hosts ran one 2-process job"
        assert "TRACE RL (trace): 1 steps" in output
        assert SEARCHED.search(server_log.read_text()), "no search answered by the README's server"
        records = [json.loads(line) for line in epath.Path(workdir, "metrics.jsonl").read_text().splitlines()]
        failures = [r["rollout/retrieval_failures"] for r in records if "rollout/retrieval_failures" in r]
        assert failures and not any(failures), records
        export = epath.Path(workdir, recipes.EXPORT_DIR)
        assert (export / "config.json").is_file()
        paths.copy_tree(export, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.get_vocab() == load_tokenizer(local / "Qwen3-8B").get_vocab()
    assert np.isfinite(torch_logits(model, np.asarray([tokenizer.encode("Where was Kalo born?")]))).all()
