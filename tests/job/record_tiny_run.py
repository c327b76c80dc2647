"""Records the tiny run's summary for ``test_the_tiny_run_prints_its_recorded_summary``::

    python -m tests.job.record_tiny_run

Re-record only when a change to the code is meant to change what the main job computes, and then re-measure the
default run's figures (``python -m trace_jax.train``) in docs/benchmarks.md ("The default run's figures") and the
README, and quote the new digest there.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

from tests.helpers import cpu_fingerprint, summary_digest
from tests.job.test_train import RECORD, ROOT, TINY, command, computed_summary


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(command(f"{tmp}/run", f"{tmp}/cache"), cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        summary = computed_summary(json.loads(pathlib.Path(tmp, "run", "summary.json").read_text()))
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"cpu": cpu_fingerprint(), "flags": TINY, "summary": summary}, indent=2) + "\n")
    print(f"wrote {RECORD}; digest {summary_digest(summary)}")


if __name__ == "__main__":
    main()
