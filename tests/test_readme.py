"""The README's test command is the one CI runs."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    test_command = 'pip install -e ".[test]" && python -m pytest -q tests'
    assert test_command in readme
    assert test_command in ci_lines
