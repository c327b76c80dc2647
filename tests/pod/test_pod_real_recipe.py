"""Journey (a) with the real recipe: ``launch/tpu_pod.sh --create --watch`` on the 2-host pod in a box
(``tests/pod/journeys.py``) runs ``configs/search_r1.py:tiny`` with every input in an emulated bucket (a tiny
Qwen3 HF directory, Search-R1 parquet / jsonl question files and a corpus, ``tests/search_r1_fixtures.py``) and
the workdir there too: nothing is copied onto a host. One RL step; the export lands in the bucket, where
transformers loads it."""

from __future__ import annotations

import numpy as np
from etils import epath

from tests import search_r1_fixtures as fixtures
from tests.gcs_emulator import gcs_emulator
from tests.helpers import torch_logits
from tests.pod import fake_gcloud
from tests.pod.journeys import HEARTBEAT_TIMEOUT_S, Launch, host_log, launch_command, make_box
from trace_jax import paths
from trace_jax.data.tokenizer import load_tokenizer
from trace_jax.job import recipes

TPU = "box-r1"


def test_a_the_search_r1_recipe_reads_its_inputs_from_the_bucket_on_every_host_and_exports_there(tmp_path):
    """Fails on any host that reads an input as a local path (``pathlib.Path`` / ``open`` on ``data.dir``, the
    checkpoint or the corpus: the hosts' folders hold none of them), and on an export that does not reach the
    bucket or that transformers cannot load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = fixtures.write_all(tmp_path / "files")
    box = make_box(tmp_path)
    with gcs_emulator("bucket") as gcs:
        job_env = {**gcs.env, "JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
        flags = [
            *fixtures.in_bucket(files, gcs),
            f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
        ]
        command = launch_command(TPU, gcs.gs("run"), job_env, *flags, config="configs/search_r1.py:tiny")
        try:
            code, output = Launch(box, command, tmp_path / "launch.log").finish(timeout_s=900)
            host_1 = host_log(box, TPU, 1)
        finally:
            fake_gcloud.delete(box.root, TPU)  # kills whatever still runs there
        assert code == 0, output[-3000:] + "\nhost 1:\n" + host_1[-3000:]
        assert "watch: the job finished (exit status 0)" in output
        assert "connected to 1 peer ranks" in output, "premise: the hosts ran one 2-process job"
        assert "TRACE RL (trace): 1 steps" in output
        export = epath.Path(gcs.gs("run", recipes.EXPORT_DIR))
        assert (export / "config.json").is_file()
        paths.copy_tree(export, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tokenizer.get_vocab() == load_tokenizer(files["hf"]).get_vocab()
    assert np.isfinite(torch_logits(model, np.asarray([tokenizer.encode("Where was Kalo born?")]))).all()
