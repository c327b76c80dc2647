"""Local steps of ``launch/tpu_pod.sh`` that are clearer in Python than in bash.

    python launch/pod_helper.py check CONFIG [--config.a.b=v ...]   # exit 2 naming each key the config lacks
    python launch/pod_helper.py pack OUT.tgz                          # this checkout's code as a tarball
    python launch/pod_helper.py plan ACCELERATOR CONFIG [--config.a.b=v ...] [-- PLANNER ARGS]
                                                    # compile the job for the slice; exit 3 if it does not fit
    python launch/pod_helper.py layout ACCELERATOR CONFIG [--config.a.b=v ...] [-- PLANNER ARGS]
                                                    # let the plan pick the layout: its overrides on stdout
    python launch/pod_helper.py layout-from PLAN.json ACCELERATOR CONFIG [--config.a.b=v ...]
                                                    # the layout a saved plan picked: its overrides on stdout

``check`` runs before anything is created or shipped: a misspelt override found on a 64-chip slice costs
the minutes of installing and compiling on every host first. ``pack`` ships exactly what the user has
locally (tracked files and untracked ones git does not ignore, uncommitted edits included), never a fixed
repository URL, and never the virtual environment, run directories or git history. ``layout`` searches the
train step's layouts for the slice (mesh, micro-batch rows, remat), checks the engine on the mesh it picks, and
prints the job's overrides for that layout (``trace_jax.plan.layout_overrides``), one a line; an override that
pins a layout key makes it check that layout instead (``plan``) and print nothing. ``layout-from`` prints the
overrides of the layout a saved plan picked (``python -m trace_jax.plan --json``, or a committed one in docs/plans/)
after checking that it planned this job's model on this accelerator.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Without git (a copied tree), these are never shipped: environments, caches and run outputs.
SKIP_DIRS = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", ".ruff_cache", "runs", "bench_results"}
LARGE_FILE_BYTES = 50 * 2**20


def check(config_spec: str, overrides: list[str]) -> int:
    """0 when every ``--config.x=v`` names a key of ``config_spec``'s config, else 2 with one line per bad key."""
    sys.path.insert(0, str(ROOT))
    try:
        from trace_jax.configs import load_config_file, unknown_overrides

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


def job_model(run) -> str:
    """The planner's model preset for the job: ``sft.model``, or the real recipe's variant (e.g. ``qwen3-8b``)."""
    return run.sft.model if run.recipe.kind == "synthetic" else run.recipe.variant


def search_rows(run, chips: int) -> int:
    """The rows the layout search plans a step for: the most a step trains, one a rollout
    (``rl.prompts_per_step`` x ``allocation.rollouts_per_prompt``; the prompts alone when the budget is None),
    rounded up to whole rows a chip of every slice."""
    rollouts = run.rl.prompts_per_step * (run.allocation.rollouts_per_prompt or 1)
    shards = chips * run.mesh.slices
    return math.ceil(rollouts / shards) * shards


def plan_command(
    accelerator: str, config_spec: str, overrides: list[str], extra: list[str], search: bool = False
) -> list[str]:
    """The planner's command line for this job on ``accelerator``: the model preset (``sft.model``, or the real
    recipe's variant, e.g. ``qwen3-8b``), the job's mesh, micro-batch rows (``ppo.micro_rows``; 0 is one row per
    batch shard), remat (``ppo.remat``; "": the preset's) and windowed matmuls (``ppo.windowed_einsum``), its
    longest training row (the largest ``batch.length_buckets`` or ``batch.pack_length``), the engine's slots,
    window and dtypes, and ``--require-fit``; ``extra`` (planner options) is appended, so it can override any of
    them. ``search``: the train step alone, its layout searched (no mesh, micro-batch rows or remat given;
    windowed matmuls both ways) for :func:`search_rows` rows."""
    sys.path.insert(0, str(ROOT))
    from trace_jax.configs import load  # the package: installed or this checkout
    from trace_jax.plan.topology import parse_topology  # no jax import

    run = load(config_spec, overrides)  # the job's own RunConfig: its defaults, overrides and checks
    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "expert": run.mesh.expert, "tensor": run.mesh.tensor}
    seq_len = run.batch.pack_length or max(run.batch.length_buckets)
    engine, ppo, model = run.engine, run.ppo, run.model
    if search:  # the chosen layout is also compiled without windowed matmuls; the faster is kept
        layout = ["--rows", str(search_rows(run, parse_topology(accelerator).chips)), "--windowed-einsum", "auto"]
    else:
        layout = [
            "--mesh", ",".join(f"{k}={v}" for k, v in axes.items()),
            "--micro-rows", str(ppo.micro_rows),
            *(["--remat", ppo.remat] if ppo.remat else []),  # "": the preset's, the planner's default too
            "--windowed-einsum", "on" if ppo.windowed_einsum else "off",
            "--rows", "-1",
            "--max-compiles", "1",
        ]  # fmt: skip
    return [
        "-m", "trace_jax.plan",
        "--model", job_model(run),
        "--topology", accelerator,
        *layout,
        "--mini-batches", str(ppo.mini_batches),
        "--ppo-epochs", str(ppo.ppo_epochs),
        "--seq-len", str(seq_len),
        *(["--dtype", model.dtype] if model.dtype else []),  # "": the model's own default, the planner's too
        *(["--param-dtype", model.param_dtype] if model.param_dtype else []),
        "--slots", str(engine.max_slots),
        "--engine-len", str(engine.max_len),
        "--steps-per-call", str(engine.steps_per_call),
        "--engine-dtype", engine.weight_dtype,
        *(["--kv-dtype", engine.cache_dtype] if engine.cache_dtype else []),  # None: the engine's compute dtype
        *(["--slices", str(run.mesh.slices)] if run.mesh.slices > 1 else []),  # each slice plans its share
        "--no-depth-check",
        "--no-slots-fit",
        "--require-fit",
        *(["--slots", "0"] if search else []),  # the engine is checked on the mesh the search picks
        *extra,
    ]  # fmt: skip


def _split(argv: list[str]) -> tuple[str, str, list[str], list[str]]:
    """``ACCELERATOR CONFIG [OVERRIDES] [-- PLANNER ARGS]`` as its four parts."""
    accelerator, config_spec, rest = argv[0], argv[1], argv[2:]
    overrides, extra = (rest[: rest.index("--")], rest[rest.index("--") + 1 :]) if "--" in rest else (rest, [])
    return accelerator, config_spec, overrides, extra


def _run_planner(accelerator, config_spec, overrides, extra, search: bool = False) -> int:
    """Runs ``plan_command``'s planner, its output on stderr (stdout is the layout's); its exit status: 0 fits,
    3 does not, 2 bad input."""
    try:
        command = [sys.executable, *plan_command(accelerator, config_spec, overrides, extra, search)]
    except Exception as e:  # the user's local environment: say what is missing and how to go on
        problem = f"{type(e).__name__}: {e}"
        print(f"error: cannot build the plan of {config_spec} ({problem}); pass --skip-plan", file=sys.stderr)
        return 2
    print("plan: " + " ".join(command[1:]), file=sys.stderr, flush=True)
    return subprocess.run(command, cwd=ROOT, stdout=sys.stderr, check=False).returncode


def plan(argv: list[str]) -> int:
    """Runs the planner for the job's own layout (``plan_command``); its exit status: 0 fits, 3 does not."""
    return _run_planner(*_split(argv))


def layout(argv: list[str]) -> int:
    """Lets the plan pick the job's layout: searches the train step's layouts, checks the engine on the mesh
    picked, and prints that layout's overrides on stdout, one a line (exit 0); 3 when nothing fits. Overrides
    that pin a layout key: that layout is checked (``plan``) and nothing printed."""
    sys.path.insert(0, str(ROOT))
    from trace_jax.configs import load  # the package: installed or this checkout
    from trace_jax.plan.layout_overrides import NoLayout, layout_overrides, pinned_keys

    accelerator, config_spec, overrides, extra = _split(argv)
    pinned = pinned_keys(overrides)
    if pinned:
        print(f"note: {', '.join(pinned)} set by the overrides: the plan checks that layout", file=sys.stderr)
        return plan(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "plan.json")
        code = _run_planner(accelerator, config_spec, overrides, [*extra, "--json", out], search=True)
        if code:
            return code
        with open(out) as f:
            result = json.load(f)
    try:
        chosen = layout_overrides(result, load(config_spec, overrides).mesh.slices)
    except NoLayout as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print("layout: " + " ".join(chosen), file=sys.stderr, flush=True)
    # The engine decodes on the job's mesh: checked there (--rows 0: the train step was just compiled).
    code = _run_planner(accelerator, config_spec, [*overrides, *chosen], [*extra, "--rows", "0"])
    if code == 0:
        print("\n".join(chosen))
    return code


def layout_from(argv: list[str]) -> int:
    """Prints the overrides of the layout the saved plan ``argv[0]`` picked (one a line; exit 0), after checking
    that it planned the job's model on the accelerator (else exit 2 naming both); overrides that pin a layout
    key: nothing printed (the plan step checks that layout)."""
    sys.path.insert(0, str(ROOT))
    from trace_jax.configs import load  # the package: installed or this checkout
    from trace_jax.plan.layout_overrides import NoLayout, layout_overrides, pinned_keys

    path, (accelerator, config_spec, overrides, _) = argv[0], _split(argv[1:])
    try:
        with open(path) as f:
            result = json.load(f)
        run = load(config_spec, overrides)
        model, chosen = job_model(run), layout_overrides(result, run.mesh.slices)
    except (OSError, ValueError, NoLayout) as e:
        print(f"error: --layout-from {path}: {e}", file=sys.stderr)
        return 2
    planned = (result.get("model"), result["topology"]["name"])
    if planned != (model, accelerator):
        print(
            f"error: --layout-from {path} planned {planned[0]} on {planned[1]}; this launch runs {model} on "
            f"{accelerator}: plan this job (--plan-layout) or pass a plan of it",
            file=sys.stderr,
        )
        return 2
    pinned = pinned_keys(overrides)
    if pinned:
        print(f"note: {', '.join(pinned)} set by the overrides: {path}'s layout is not used", file=sys.stderr)
        return 0
    print(f"layout from {path}: " + " ".join(chosen), file=sys.stderr)
    print("\n".join(chosen))
    return 0


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
    if len(argv) >= 3 and argv[0] == "plan":
        return plan(argv[1:])
    if len(argv) >= 3 and argv[0] == "layout":
        return layout(argv[1:])
    if len(argv) >= 4 and argv[0] == "layout-from":
        return layout_from(argv[1:])
    print(
        "usage: pod_helper.py check CONFIG [--config.key=value ...] | pod_helper.py pack OUT.tgz | "
        "pod_helper.py plan|layout ACCELERATOR CONFIG [--config.key=value ...] [-- PLANNER ARGS] | "
        "pod_helper.py layout-from PLAN.json ACCELERATOR CONFIG [--config.key=value ...]",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
