"""The package's import graph: layers listed once, no cycles, no import from a lower layer to a higher one, and
every import inside a function says why it is there (a comment on its line or the line above).

Edges are read from the source with ``ast`` (nothing is imported). Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so an edge to a module is also an edge to each package above it: a cycle through a
package's public namespace counts.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "trace_jax"

# Lowest first. An import goes down or sideways (within a layer), never up. A module belongs to the longest
# prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    ("trace_jax", "trace_jax.registry", "trace_jax.buckets", "trace_jax.config_utils", "trace_jax.paths"),
    ("trace_jax.optim",),
    ("trace_jax.parallel",),
    ("trace_jax.kernels",),  # the Pallas kernels and their wrappers: models and rollout call them
    ("trace_jax.models", "trace_jax.envs"),
    ("trace_jax.data",),
    ("trace_jax.checkpoint", "trace_jax.rollout"),
    ("trace_jax.allocation", "trace_jax.rl"),
    ("trace_jax.configs",),  # the run's typed config and what config files build it from
    ("trace_jax.cluster",),  # where sampling runs beside training (the RL cluster)
    ("trace_jax.job.cli", "trace_jax.job.metrics", "trace_jax.job.heap"),  # the job's console, metrics and heap
    ("trace_jax.job",),
    ("trace_jax.bench", "trace_jax.plan"),
    ("trace_jax.train", "trace_jax.evaluate", "trace_jax.hf"),  # the commands: each only calls trace_jax.job
]


def modules(root: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(name: str, known: dict[str, pathlib.Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(known: dict[str, pathlib.Path]) -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Internal import edges (module -> modules and packages it makes Python run) and function-level imports
    that give no reason: (module, line, statement)."""
    edges: dict[str, set[str]] = collections.defaultdict(set)
    unexplained = []
    for name, path in known.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base]).strip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                found = _target(target, known) if target.startswith("trace_jax") else None
                while found and found != "trace_jax":
                    if found != name and not name.startswith(found + "."):
                        edges[name].add(found)
                    found = found.rpartition(".")[0]
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom) and not _explained(lines, node.lineno - 1):
                    unexplained.append((name, node.lineno, ast.unparse(node)))
    return edges, unexplained


def _explained(lines: list[str], at: int) -> bool:
    """A comment on the import's line, or on a line of the block of imports (blank lines included) it is in, or
    on the line just above that block."""
    while at >= 0:
        line = lines[at].strip()
        comment = line.partition("#")[2]
        if re.sub(r"noqa(: [A-Z0-9, ]+)?", "", comment).strip():  # a linter directive is not a reason
            return True
        if line and not line.startswith(("import ", "from ")):
            return False
        at -= 1
    return False


def layer_of(name: str) -> int:
    best, length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))


def test_the_checks_catch_a_cycle_and_an_upward_import():
    # Premise: the two mutants this test exists for are caught.
    assert cycles({"trace_jax.rl.batch": {"trace_jax.rl.losses"}, "trace_jax.rl.losses": {"trace_jax.rl.batch"}})
    assert upward({"trace_jax.models.qwen": {"trace_jax.job.train"}}) == [
        ("trace_jax.models.qwen", "trace_jax.job.train")
    ]


def test_the_graph_sees_imports_through_packages(tmp_path):
    root = tmp_path / "trace_jax"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("from trace_jax.low.a import x\n")
    (root / "low" / "a.py").write_text("def f():\n    import trace_jax.low.b\n")
    (root / "low" / "b.py").write_text(
        "from trace_jax.low.a import x  # a reason\ndef g():\n    import os  # noqa: F401\n"
    )
    edges, unexplained = import_graph(modules(root))
    assert edges["trace_jax.low.b"] == {"trace_jax.low.a"}  # and not its own package
    assert sorted((m, line) for m, line, _ in unexplained) == [("trace_jax.low.a", 2), ("trace_jax.low.b", 3)]


def test_no_cycles_no_upward_imports_and_every_lazy_import_says_why():
    known = modules()
    assert len(known) > 90 and "trace_jax.job.train" in known  # the premise: the whole package was read
    edges, unexplained = import_graph(known)
    assert sum(len(t) for t in edges.values()) > 300
    for name in known:
        layer_of(name)  # every module has a layer
    assert cycles(edges) == []
    assert upward(edges) == []
    assert unexplained == [], "an import inside a function needs a one-line reason (a comment on it or above it)"


def test_the_package_root_holds_only_shared_low_level_modules_and_the_commands():
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    commands = {"train", "evaluate", "hf"}
    assert set(root) - commands == {"buckets", "config_utils", "optim", "paths", "registry"}
    assert len(root) <= 8
    for command in commands:  # a command only calls trace_jax.job.commands
        assert len((PACKAGE / f"{command}.py").read_text().splitlines()) <= 10


def job_imports(source: str) -> list[str]:
    """The ``trace_jax.job`` modules a source imports (at any depth of the file)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [name for name in names if name == "trace_jax.job" or name.startswith("trace_jax.job.")]
    return found


def test_config_files_build_their_sections_below_the_job():
    """Config files import ``trace_jax.configs`` (and parts below it), never the job wing: the mutant is a config
    file that builds a section with ``trace_jax.job.build`` or imports ``RLConfig`` from the job."""
    assert job_imports("from trace_jax.job.build import section\nimport trace_jax.job\n") == [
        "trace_jax.job.build",
        "trace_jax.job",
    ]  # premise: the check sees both forms
    files = sorted((PACKAGE.parent / "configs").glob("*.py"))
    assert len(files) >= 6
    assert {path.name: job_imports(path.read_text()) for path in files} == {path.name: [] for path in files}
