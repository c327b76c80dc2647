"""docs/extending.md: every worked example runs, in a fresh namespace, and leaves the registries as it found them."""

import pathlib
import re

import pytest

from trace_jax.allocation.policies import POLICIES
from trace_jax.envs.retrieval.retriever import RETRIEVERS
from trace_jax.models import MODEL_FAMILIES, PRESETS
from trace_jax.rl.advantages import ESTIMATORS

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
HEADINGS = (
    "A new allocation policy",
    "A new advantage estimator",
    "A new model family",
    "A new environment or tool",
    "A new retriever",
)
# Global tables an example may add to; whatever it adds is taken out again after it ran.
TABLES = {
    "POLICIES": POLICIES,
    "ESTIMATORS": ESTIMATORS,
    "MODEL_FAMILIES": MODEL_FAMILIES,
    "PRESETS": PRESETS,
    "RETRIEVERS": RETRIEVERS,
}


def examples() -> dict[str, str]:
    """The ```python block under each ``## `` heading of the doc (headings without one map to "")."""
    found: dict[str, str] = {}
    for section in re.split(r"^## ", DOC.read_text(), flags=re.MULTILINE)[1:]:
        heading, _, body = section.partition("\n")
        blocks = re.findall(r"^```python\n(.*?)^```", body, flags=re.MULTILINE | re.DOTALL)
        found[heading.strip()] = "\n".join(blocks) if len(blocks) == 1 else f"<{len(blocks)} python blocks>"
    return found


def test_the_doc_has_exactly_one_python_block_per_heading():
    text = DOC.read_text()
    assert len(re.findall(r"^```python\n", text, flags=re.MULTILINE)) == len(HEADINGS) == 5
    found = examples()
    assert tuple(found) == HEADINGS
    assert all(not code.startswith("<") and code.strip() for code in found.values())


@pytest.mark.parametrize("heading", HEADINGS)
def test_example_runs(heading, monkeypatch):
    code = examples()[heading]
    monkeypatch.chdir(ROOT)  # the examples read configs/default.py, as a run from the repository root does
    before = {name: set(table) for name, table in TABLES.items()}
    try:
        exec(compile(code, f"{DOC}:{heading}", "exec"), {"__name__": f"extending_example_{HEADINGS.index(heading)}"})
    finally:
        for name, table in TABLES.items():
            for added in set(table) - before[name]:
                del table[added]
    # Each example registers a part under a name the framework did not know (so running it again works).
    assert all(set(table) == before[name] for name, table in TABLES.items())
