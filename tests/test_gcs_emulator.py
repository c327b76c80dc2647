"""The test emulator serves the real clients a pod runs: what epath (gcsfs) writes, tensorstore's gcs kvstore (orbax's
arrays) reads back, and the other way round. Mutant caught: an endpoint variable missing from ``emulator_env`` sends
that client to the real service, which this machine cannot reach."""

import tensorstore as ts
from etils import epath

from tests.gcs_emulator import gcs_emulator


def test_epath_and_tensorstore_share_the_emulated_bucket():
    with gcs_emulator("pod-bucket") as gcs:
        epath.Path(gcs.gs("run", "note.txt")).write_text("written by epath")
        store = ts.KvStore.open({"driver": "gcs", "bucket": gcs.bucket}).result()
        assert store.read("run/note.txt").result().value == b"written by epath"
        store.write("run/array.bin", b"\x00\x01written by tensorstore").result()
        assert epath.Path(gcs.gs("run", "array.bin")).read_bytes() == b"\x00\x01written by tensorstore"
        assert sorted(p.name for p in epath.Path(gcs.gs("run")).iterdir()) == ["array.bin", "note.txt"]
