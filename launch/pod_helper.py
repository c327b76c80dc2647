"""Local steps of ``launch/tpu_pod.sh`` that are clearer in Python than in bash.

    python launch/pod_helper.py check CONFIG [--config.a.b=v ...]   # exit 2 naming each key the config lacks
    python launch/pod_helper.py pack OUT.tgz                          # this checkout's code as a tarball

``check`` runs before anything is created or shipped: a misspelt override found on a 64-chip slice costs
the minutes of installing and compiling on every host first. ``pack`` ships exactly what the user has
locally (tracked files and untracked ones git does not ignore, uncommitted edits included), never a fixed
repository URL, and never the virtual environment, run directories or git history.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Without git (a copied tree), these are never shipped: environments, caches and run outputs.
SKIP_DIRS = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "bench_results"}
LARGE_FILE_BYTES = 50 * 2**20


def check(config_spec: str, overrides: list[str]) -> int:
    """0 when every ``--config.x=v`` names a key of ``config_spec``'s config, else 2 with one line per bad key."""
    sys.path.insert(0, str(ROOT))
    try:
        from trace_jax.config_utils import load_config_file, unknown_overrides

        config = load_config_file(config_spec)
    except Exception as e:  # the user's local environment: say what is missing and how to go on
        print(
            f"error: cannot load {config_spec} locally to check the overrides ({type(e).__name__}: {e}); "
            "install the package here (pip install -e .) or pass --skip-check",
            file=sys.stderr,
        )
        return 2
    malformed = [o for o in overrides if not o.startswith("--config.") or "=" not in o]
    problems = [f"override {o!r} is not of the form --config.key=value" for o in malformed]
    problems += unknown_overrides([o for o in overrides if o not in malformed], config)
    for problem in problems:
        print(f"error: {problem} (in {config_spec})", file=sys.stderr)
    return 2 if problems else 0


def _files() -> list[str]:
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = [n for n in listed.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            names += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in filenames]
    # Tracked but deleted in the working tree: ship the tree as it is.
    return sorted(n for n in names if (ROOT / n).is_file())


def pack(out: str) -> int:
    names = _files()
    for name in names:
        if (ROOT / name).stat().st_size > LARGE_FILE_BYTES:
            print(f"warning: shipping the large file {name} to every worker", file=sys.stderr)
    with tarfile.open(out, "w:gz") as tar:
        for name in names:
            tar.add(ROOT / name, arcname=name, recursive=False)
    print(f"packed {len(names)} files of {ROOT} into {out} ({os.path.getsize(out) / 2**20:.1f} MiB)")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "check":
        return check(argv[1], argv[2:])
    if len(argv) == 2 and argv[0] == "pack":
        return pack(argv[1])
    print("usage: pod_helper.py check CONFIG [--config.key=value ...] | pod_helper.py pack OUT.tgz", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
