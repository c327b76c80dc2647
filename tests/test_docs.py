"""The documentation: no build-history wording, every relative link resolves, the README stays a guide, and every
figure quoted from a reference page (docs/benchmarks.md, docs/evidence.md) equals the figure there."""

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Assembled from pieces so that this file does not match its own pattern.
HISTORY_WORDS = ("ses" + "sion", "wa" + "ve", "is" + "sue")
HISTORY = re.compile(r"\b(?:" + "|".join(HISTORY_WORDS) + r")\s+\d", re.IGNORECASE)
SCANNED_DIRS = ("trace_jax", "configs", "tests", "launch", "notebooks")
SCANNED_SUFFIXES = {".py", ".sh", ".ipynb", ".md"}
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints"}

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HTML_ANCHOR = re.compile(r'<a id="([\w-]+)"></a>')

# The reference pages: one current figure per claim. A figure others quote is a table row whose first cell starts
# with its anchor, <a id="fig-..."></a>, and whose second cell is the figure; a quote is a link whose text is the
# figure and whose target is that anchor.
REFERENCE_PAGES = ("docs/benchmarks.md", "docs/evidence.md")
FIGURE_ROW = re.compile(r'^\|\s*<a id="(fig-[\w-]+)"></a>[^|]*\|\s*([^|]*?)\s*\|', re.MULTILINE)
FIGURE_QUOTE = re.compile(r"\[([^\[\]]+)\]\(((?:[\w./-]*/)?(?:benchmarks|evidence)\.md)#(fig-[\w-]+)\)")


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def scanned_files() -> list[pathlib.Path]:
    files = markdown_files()
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in SCANNED_SUFFIXES and not SKIPPED_PARTS & set(path.parts):
                files.append(path)
    return files


def history_hits(path: pathlib.Path) -> list[str]:
    text = path.read_text(errors="replace")
    return [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for m in HISTORY.finditer(text)
    ]


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked out (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    text = FENCE.sub("", path.read_text())
    for match in HEADING.finditer(text):
        slug = github_slug(match.group(1))
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result | set(HTML_ANCHOR.findall(text))


def broken_links(path: pathlib.Path) -> list[str]:
    """Relative links of a Markdown file whose file does not exist, or whose #anchor is no heading there."""
    broken = []
    for target in LINK.findall(without_code(path.read_text())):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part) if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


# ------------------------------------------------------------------------------------------ history wording
def test_the_history_pattern_matches_planted_samples():
    planted = [
        "measured in " + HISTORY_WORDS[0].capitalize() + " 4",
        "the code of " + HISTORY_WORDS[1] + " 2",
        "asked for by " + HISTORY_WORDS[2].upper() + "\n15",
    ]
    for sample in planted:
        assert HISTORY.search(sample), sample
    for harmless in [HISTORY_WORDS[0] + "s 3", HISTORY_WORDS[1] + "let 2", "no " + HISTORY_WORDS[2] + " here"]:
        assert not HISTORY.search(harmless), harmless


def test_docs_and_code_do_not_narrate_how_the_project_was_built():
    files = scanned_files()
    assert ROOT / "README.md" in files and any(f.suffix == ".ipynb" for f in files)
    hits = [hit for path in files for hit in history_hits(path)]
    assert not hits, "build-history wording:\n" + "\n".join(hits)


# ------------------------------------------------------------------------------------------ links
def test_the_link_check_finds_planted_bad_links(tmp_path):
    (tmp_path / "other.md").write_text("# Good heading\n\n## Twice\n\n## Twice\n")
    (tmp_path / "here.md").write_text(
        "# Start: here\n\n"
        "[fine](other.md#good-heading) [fine too](other.md#twice-1) ![img](other.md) [self](#start-here)\n"
        "[web](https://example.com/nothing) `[code](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n```\n\n"
        "[gone](missing.md) [bad anchor](other.md#no-such) [bad self](#nowhere) ![gone image](pic.png)\n"
    )
    assert broken_links(tmp_path / "here.md") == [
        "missing.md (no such file)",
        "other.md#no-such (no heading #no-such in other.md)",
        "#nowhere (no heading #nowhere in here.md)",
        "pic.png (no such file)",
    ]


def test_github_slugs():
    assert github_slug("Train-step FLOP/s") == "train-step-flops"
    assert github_slug("Quick start: the two commands") == "quick-start-the-two-commands"
    assert github_slug("A 3.4M-parameter policy: `configs/realistic_large.py`") == (
        "a-34m-parameter-policy-configsrealistic_largepy"
    )


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: broken links:\n" + "\n".join(broken_links(path))


def test_every_docs_image_is_shown_somewhere():
    text = "\n".join(p.read_text() for p in markdown_files())
    images = sorted((ROOT / "docs").rglob("*.png"))
    assert images
    orphans = [p.relative_to(ROOT) for p in images if p.name not in text]
    assert not orphans, f"images no Markdown file links to: {orphans}"


# ------------------------------------------------------------------------------------------ quoted figures
def reference_figures(texts: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``(page#anchor -> figure, anchors defined more than once across the pages)`` of reference page texts."""
    figures, seen, twice = {}, set(), []
    for page, text in texts.items():
        for anchor, value in FIGURE_ROW.findall(text):
            if anchor in seen:
                twice.append(anchor)
            seen.add(anchor)
            figures[f"{page}#{anchor}"] = value.replace("**", "").strip()
    return figures, twice


def misquoted_figures(path: pathlib.Path, text: str, figures: dict[str, str]) -> list[str]:
    """Links of ``text`` (a file at ``path``) to a reference figure whose text is not that figure, or whose
    anchor names no figure."""
    wrong = []
    for quoted, target, anchor in FIGURE_QUOTE.findall(without_code(text)):
        page = (path.parent / target).resolve().relative_to(ROOT).as_posix()
        value = figures.get(f"{page}#{anchor}")
        if value != quoted.replace("**", "").strip():
            wrong.append(f"{path.name}: [{quoted}] -> {page}#{anchor} holds {value!r}")
    return wrong


def test_the_figure_check_finds_planted_misquotes(tmp_path):
    page = '| claim | figure |\n|---|---|\n| <a id="fig-speed"></a>speed | **4.89×** |\n'
    figures, twice = reference_figures({"docs/benchmarks.md": page, "docs/evidence.md": page})
    assert figures == {"docs/benchmarks.md#fig-speed": "4.89×", "docs/evidence.md#fig-speed": "4.89×"}
    assert twice == ["fig-speed"]
    readme = ROOT / "README.md"
    good = "[4.89×](docs/benchmarks.md#fig-speed) and **[4.89×](docs/benchmarks.md#fig-speed)**"
    assert misquoted_figures(readme, good, figures) == []
    bad = "[4.05×](docs/benchmarks.md#fig-speed) [1×](docs/benchmarks.md#fig-gone) `[9×](docs/benchmarks.md#fig-x)`"
    assert misquoted_figures(readme, bad, figures) == [
        "README.md: [4.05×] -> docs/benchmarks.md#fig-speed holds '4.89×'",
        "README.md: [1×] -> docs/benchmarks.md#fig-gone holds None",
    ]


def test_every_quoted_figure_equals_its_reference_and_each_claim_has_one_row():
    texts = {page: (ROOT / page).read_text() for page in REFERENCE_PAGES}
    figures, twice = reference_figures(texts)
    assert not twice, f"figures defined twice on the reference pages: {twice}"
    quotes = {path: path.read_text() for path in markdown_files()}
    assert len(FIGURE_QUOTE.findall(quotes[ROOT / "README.md"])) >= 20  # the premise: the README quotes by anchor
    wrong = [w for path, text in quotes.items() for w in misquoted_figures(path, text, figures)]
    assert not wrong, "figures that differ from their reference row:\n" + "\n".join(wrong)


def test_the_readme_em_table_is_the_reference_pages():
    table = re.compile(r"^\| group \| n \| EM after SFT \| EM after TRACE RL \|\n(?:\|.*\|\n)+", re.MULTILINE)
    (readme,) = table.findall((ROOT / "README.md").read_text())
    (reference,) = table.findall((ROOT / "docs" / "benchmarks.md").read_text())
    assert readme == reference


def test_the_reference_pages_are_not_logs():
    """Runs, pilots and superseded tables live in docs/log/; a reference page names no commit (a figure of
    earlier code is a log entry; the tiny run's 12-digit record digest is no commit) and links to its log."""
    for page in REFERENCE_PAGES:
        text = (ROOT / page).read_text()
        assert "](log/" in text, page
        commits = re.findall(r"`(?:[0-9a-f]{7,10}|[0-9a-f]{40})`", text)  # git's short or full hashes
        assert not commits, f"{page} cites commits {commits}: that run belongs in docs/log/"


# ------------------------------------------------------------------------------------------ the README's size
def test_readme_is_a_guide_not_a_log():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert 250 <= lines <= 400, f"README.md has {lines} lines; measurements belong in docs/"


# ------------------------------------------------------------------------------------------ .gitignore
def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


def test_no_tracked_file_is_ignored():
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout")
    # The premise: .gitignore is read (bench results are ignored).
    assert _git("check-ignore", "-q", "--no-index", "bench_results/decode.json").returncode == 0
    ignored = _git("ls-files", "--cached", "--ignored", "--exclude-standard").stdout.split()
    assert not ignored, f"tracked but matched by .gitignore: {ignored}"
