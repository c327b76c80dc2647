"""What the README promises: its commands are the real ones, the paths, modules and registries it names exist,
and the layer order it states is the one the code keeps."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

MAIN_COMMAND = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m trace_jax.train"
TEST_COMMAND = 'pip install -e ".[test]" && python -m pytest -q tests'
PATH_ROOTS = ("trace_jax/", "configs/", "launch/", "tests/", "notebooks/", "docs/", ".ci/")
EXTENDING_ANCHORS = (
    "a-new-allocation-policy",
    "a-new-advantage-estimator",
    "a-new-model-family",
    "a-new-environment-or-tool",
    "a-new-retriever",
)


def readme() -> str:
    return README.read_text()


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


# ------------------------------------------------------------------------------------------ the two commands
def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert TEST_COMMAND in ci_lines
    assert [TEST_COMMAND] in [block.splitlines() for block in bash_blocks(readme())]


def test_the_main_job_command_is_a_block_of_its_own():
    assert [MAIN_COMMAND] in [block.splitlines() for block in bash_blocks(readme())]
    altered = "```bash\n" + MAIN_COMMAND + " --oops\n```\n"
    assert [MAIN_COMMAND] not in [block.splitlines() for block in bash_blocks(altered)]


# ------------------------------------------------------------------------------------------ named paths
def named_paths(text: str) -> list[str]:
    """Repository paths the text names in backticks (``configs/x.py:arm`` and ``configs/x.py[:arm]`` -> the file)."""
    paths = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for word in span.split():
            path = re.split(r"[:\[]", word)[0].rstrip(".,;)")
            if path.startswith(PATH_ROOTS) and not any(c in path for c in "{}<>*$"):
                paths.append(path)
    return paths


def missing_paths(text: str) -> list[str]:
    return [p for p in named_paths(text) if not (ROOT / p).exists()]


def test_the_path_check_finds_a_planted_missing_path():
    planted = "`configs/default.py`, `configs/ablation.py:uniform`, `configs/realistic.py[:<arm>]`, `trace_jax/nope.py`"
    assert named_paths(planted) == [
        "configs/default.py",
        "configs/ablation.py",
        "configs/realistic.py",
        "trace_jax/nope.py",
    ]
    assert missing_paths(planted) == ["trace_jax/nope.py"]


def test_every_path_the_readme_names_exists():
    assert len(named_paths(readme())) > 20
    assert not missing_paths(readme())


# ------------------------------------------------------------------------------------------ named commands
def module_file(module: str) -> pathlib.Path | None:
    """The file ``python -m module`` runs, when it is one of ours and has a ``__main__`` entry."""
    base = ROOT / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__main__.py"):
        if path.is_file() and (path.name == "__main__.py" or 'if __name__ == "__main__"' in path.read_text()):
            return path
    return None


def missing_commands(text: str) -> list[str]:
    modules = set(re.findall(r"python3? -m (trace_jax[\w.]*)", text))
    return sorted(m for m in modules if module_file(m) is None)


def test_the_command_check_finds_a_planted_missing_command():
    assert missing_commands("python -m trace_jax.train; python -m trace_jax.nope --x") == ["trace_jax.nope"]
    assert missing_commands("python -m trace_jax.registry") == ["trace_jax.registry"]  # no __main__ entry


def test_every_command_the_readme_names_runs_a_module_of_ours():
    text = readme()
    for command in ("trace_jax.train", "trace_jax.evaluate", "trace_jax.hf", "trace_jax.plan"):
        assert f"python -m {command}" in text
    assert not missing_commands(text)
    assert "python -m trace_jax.checkpoint.hf" not in text and "trace_jax.recipes" not in text


# ------------------------------------------------------------------------------------------ extending
def dotted_names_missing(text: str) -> list[str]:
    """``trace_jax.a.b.NAME`` in backticks whose module file or package, or top-level ``NAME``, does not exist."""
    missing = []
    for name in set(re.findall(r"`(trace_jax(?:\.\w+)+)`", text)):
        base = ROOT / name.replace(".", "/")
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            continue
        module, _, attribute = name.rpartition(".")
        path = ROOT / module.replace(".", "/")
        source = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        defined = rf"^(?:{attribute}\b\s*[:=]|(?:def|class) {attribute}\b|from \S+ import .*\b{attribute}\b)"
        if not (source.is_file() and re.search(defined, source.read_text(), re.MULTILINE)):
            missing.append(name)
    return sorted(missing)


def test_the_name_check_finds_planted_missing_names():
    planted = "`trace_jax.rl.advantages.ESTIMATORS` `trace_jax.models` `trace_jax.rl.advantages.NOPE` `trace_jax.nope`"
    assert dotted_names_missing(planted) == ["trace_jax.nope", "trace_jax.rl.advantages.NOPE"]


def test_extending_names_five_extension_points_that_exist():
    body = section(readme(), "Extending")
    for anchor in EXTENDING_ANCHORS:
        assert f"(docs/extending.md#{anchor})" in body
    for name in (
        "trace_jax.allocation.policies.POLICIES",
        "trace_jax.rl.advantages.ESTIMATORS",
        "trace_jax.models",
        "trace_jax.envs",
        "trace_jax.envs.retrieval.retriever.RETRIEVERS",
    ):
        assert f"`{name}`" in body
    assert not dotted_names_missing(readme())


# ------------------------------------------------------------------------------------------ performance at a glance
def test_performance_at_a_glance_links_each_figure_to_its_section():
    body = section(readme(), "Performance at a glance")
    rows = [line for line in body.splitlines() if line.startswith("|") and not re.match(r"^\|[\s|:-]+\|$", line)][1:]
    assert 5 <= len(rows) <= 8
    for row in rows:
        assert re.search(r"\]\(docs/(benchmarks|evidence)\.md#[\w-]+\)", row), row
        figure = row.split("|")[2]
        assert re.search(r"\]\(docs/(benchmarks|evidence)\.md#fig-[\w-]+\)", figure), (
            f"quotes no reference figure: {row}"
        )


def test_the_default_run_shows_one_em_table_and_its_plot():
    body = section(readme(), "What the main job does, and what you get")
    assert "![" in body and "(docs/default_run_reward_em.png)" in body
    assert len(re.findall(r"^\| group \| n \| EM after SFT \| EM after TRACE RL \|$", body, re.MULTILINE)) == 1


def test_no_placeholder_is_left_unfilled():
    left = re.findall(r"\{\{[^}]*\}\}", readme())
    assert not left, f"{len(left)} placeholders to fill with measured figures, e.g. {left[0]}"


# ------------------------------------------------------------------------------------------ layers
def stated_layers(text: str) -> dict[str, int]:
    """The README's layer list: top-level module or subpackage of trace_jax -> layer number (1 = lowest)."""
    match = re.search(r"^Layers, lowest first.*\n\n?((?:\d+\. .*\n)+)", text, re.MULTILINE)
    assert match, "README states no layer order ('Layers, lowest first' and a numbered list)"
    layers = {}
    for line in match.group(1).splitlines():
        number, _, names = line.partition(". ")
        for name in re.findall(r"`([\w.]+)`", names):
            layers[name.removeprefix("trace_jax.")] = int(number)
    return layers


def top_level_parts() -> set[str]:
    package = ROOT / "trace_jax"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    return modules | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


IMPORT = re.compile(r"^\s*(?:from|import)\s+trace_jax\.(\w+)", re.MULTILINE)
IMPORT_FROM_PACKAGE = re.compile(r"^\s*from\s+trace_jax\s+import\s+\(?([\w\s,]+)\)?", re.MULTILINE)


def imported_parts(text: str) -> list[str]:
    """Top-level parts of trace_jax a source imports: ``from trace_jax.a.b import c``, ``from trace_jax import a``."""
    parts = IMPORT.findall(text)
    for names in IMPORT_FROM_PACKAGE.findall(text):
        parts += [name.split()[0] for name in names.split(",") if name.strip()]
    return parts


def layer_violations(sources: dict[str, str], layers: dict[str, int]) -> list[str]:
    """``source -> imported`` pairs where a module imports from a higher layer than its own."""
    found = []
    for relative, text in sources.items():
        own = pathlib.PurePosixPath(relative).parts[0].removesuffix(".py")
        for imported in imported_parts(text):
            if own != "__init__" and layers.get(imported, 0) > layers[own]:
                found.append(f"{relative} -> trace_jax.{imported}")
    return found


def test_the_layer_check_finds_a_planted_violation():
    layers = {"registry": 1, "models": 2, "job": 5}
    planted = {
        "models/qwen.py": "import numpy\n    from trace_jax.job import train\nfrom trace_jax.registry import R\n",
        "models/attention.py": "from trace_jax import registry, job\n",
    }
    assert layer_violations(planted, layers) == [
        "models/qwen.py -> trace_jax.job",
        "models/attention.py -> trace_jax.job",
    ]


def test_the_code_keeps_the_layer_order_the_readme_states():
    layers = stated_layers(readme())
    assert set(layers) == top_level_parts(), "every top-level module of trace_jax sits in exactly one stated layer"
    package = ROOT / "trace_jax"
    sources = {str(p.relative_to(package).as_posix()): p.read_text() for p in package.rglob("*.py")}
    assert not layer_violations(sources, layers)


@pytest.mark.parametrize("title", ["Quick start: the two commands", "The terms the summary uses", "The package"])
def test_the_guide_sections_exist(title):
    assert section(readme(), title).strip()


# ------------------------------------------------------------------------------------------ counts
NUMBER_WORDS = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def test_the_policy_and_arm_counts_the_readme_states_are_the_codes():
    """Fails when a policy or an ablation arm is added (or dropped) and the README's count is not."""
    import importlib.util

    from trace_jax.allocation.policies import POLICIES

    spec = importlib.util.spec_from_file_location("ablation_config", ROOT / "configs" / "ablation.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    text = readme()
    assert len(POLICIES) >= 6 and len(ablation.ARMS) >= 10  # premise: both tables were read
    assert f"{NUMBER_WORDS[len(POLICIES)]} allocation policies" in text
    training = [p for p in POLICIES if p != "oracle"]
    assert f"the {NUMBER_WORDS[len(training)]} that train" in text
    assert all(f"`{policy}`" in section(text, "Configs, ablations and overrides") for policy in training)
    assert f"the {len(ablation.ARMS)} arms of its `ARMS` table" in text
