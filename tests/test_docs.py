"""The repository's documentation as a manual: no development history in tracked code or docs, every
repository path the manual names exists, and the README fits one reading.

History belongs in git: a "stop N" progress marker, a commit id in a page or a reference to one of
this project's own issues says when something changed, not why the code is as it is. A link to an
upstream project's tracker is a citation and stays allowed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_LEVEL = ("flows", "stages", "data_contracts", "infra", "tests", "bench", "docs")
README_LIMIT = 15_000

STOP_MARKER = re.compile(r"\bstop [0-9]", re.IGNORECASE)
OWN_ISSUE = re.compile(r"\bissues? #?[0-9]", re.IGNORECASE)
# 7 to 40 hex digits with at least one digit and one letter: a commit id, abbreviated or whole.
# Words made of a–f only ("added", "deadbeef") and plain numbers are not commit ids.
HEX_ID = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
URL = re.compile(r"https?://\S+")


def tracked(*patterns: str) -> list[Path]:
    """The repository's tracked files matching the patterns (all matching files outside virtualenvs
    and caches where the tree is not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", ".git", "__pycache__", "node_modules"}
        return [p for pattern in patterns for p in ROOT.rglob(pattern)
                if not skip.intersection(p.relative_to(ROOT).parts)]


def offences(files: list[Path], pattern: re.Pattern, strip_urls: bool = False) -> list[str]:
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            text = URL.sub("", line) if strip_urls else line
            if match := pattern.search(text):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    return found


def test_no_progress_markers_in_code_or_docs():
    found = offences(tracked("*.md", "*.py"), STOP_MARKER)
    assert not found, "development history (a 'stop N' marker) in:\n" + "\n".join(found)


def test_no_commit_ids_in_docs():
    found = offences(tracked("*.md"), HEX_ID, strip_urls=True)
    assert not found, "commit ids in the docs (history belongs in git):\n" + "\n".join(found)


def test_no_references_to_this_projects_issues():
    found = offences(tracked("*.md", "*.py"), OWN_ISSUE, strip_urls=True)
    assert not found, "references to this project's issues (say why instead):\n" + "\n".join(found)


@pytest.mark.parametrize("text, pattern, flagged", [
    ("Stop" + " 31's code", STOP_MARKER, True),
    ("nonstop" + " 3 days", STOP_MARKER, False),
    ("the tree `" + "a3da2ad" + "`", HEX_ID, True),
    ("since " + "4bfedd0" + " every side", HEX_ID, True),
    ("a3da2ad4e1f0c9b8a7d6e5f4c3b2a1d0e9f8c7b6"[:40], HEX_ID, True),
    ("deadbeef and added", HEX_ID, False),
    ("1234567 tokens", HEX_ID, False),
    ("sha256 bf16 fp32", HEX_ID, False),
    ("as in " + "issue" + " 19", OWN_ISSUE, True),
    ("(" + "issue" + " #8)", OWN_ISSUE, True),
    ("an issue with 2 ranks", OWN_ISSUE, False),
])
def test_history_patterns(text, pattern, flagged):
    assert bool(pattern.search(text)) is flagged


def test_upstream_tracker_urls_are_allowed(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See https://github.com/microsoft/DeepSpeed/issues/" + "7421 and commit "
                    "https://github.com/pytorch/pytorch/commit/" + "a3da2ad4e1f\n")
    assert offences([page], HEX_ID, strip_urls=True) == []
    assert offences([page], OWN_ISSUE, strip_urls=True) == []
    page.write_text("the tree " + "a3da2ad4e1f" + " and " + "issue" + " 19\n")
    assert len(offences([page], HEX_ID, strip_urls=True)) == 1
    assert len(offences([page], OWN_ISSUE, strip_urls=True)) == 1


# --- every path the manual names exists ---

MANUAL = ["README.md", "docs/architecture.md", "docs/results.md", "bench/README.md", "docs/guide/*.md"]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:" + "|".join(TOP_LEVEL) + r")/[\w.\-/]*|Makefile|pyproject\.toml)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def manual_pages() -> list[Path]:
    return sorted({p for pattern in MANUAL for p in ROOT.glob(pattern) if p.is_file()})


def generated(path: Path) -> bool:
    """A path git ignores: made by a command the page describes (a bench's own virtualenv)."""
    try:
        # both spellings: an ignore rule for a folder ("/bench/.venv-trl/") matches only the one with "/"
        return any(subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode == 0
                   for name in (str(path), f"{path}/"))
    except OSError:
        return False


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    found, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            text = re.sub(r"[`*]", "", match.group(1)).lower()
            found.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return found


def repository_paths(code: str) -> list[tuple[str, Path, None]]:
    """The repository paths named in a piece of code, placeholders (`stages/compute/models/<arch>.py`) left out."""
    return [(code.strip(), ROOT / match.group(1), None) for match in REPO_PATH.finditer(code)
            if not re.match(r"[<{*…]", code[match.end():match.end() + 1])]


def named_paths(page: Path, text: str | None = None) -> list[tuple[str, Path, str | None]]:
    """(as written, the path it names, its anchor) for each repository path in a code span or a
    fenced block's line (the commands a reader copies), and each relative link or image."""
    text = page.read_text(encoding="utf-8") if text is None else text
    fences = re.compile(r"^```.*?^```", flags=re.S | re.M)
    named = [found for block in fences.findall(text) for line in block.splitlines()[1:-1]
             for found in repository_paths(line)]
    text = fences.sub("", text)
    named += [found for span in CODE_SPAN.findall(text) for found in repository_paths(span)]
    for link in LINK.finditer(text):
        target = link.group(1) or link.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        named.append((target, (page.parent / path) if path else page, anchor or None))
    return named


@pytest.mark.parametrize("page", manual_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(page):
    missing = []
    for written, path, anchor in named_paths(page):
        resolved = path.resolve()
        if not resolved.is_relative_to(ROOT):
            missing.append(f"{written}: outside the repository")
        elif not resolved.exists() and not generated(resolved):
            missing.append(f"{written}: no such file or folder")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            missing.append(f"{written}: no heading '#{anchor}' in {resolved.relative_to(ROOT)}")
    assert not missing, f"{page.relative_to(ROOT)} names what the repository lacks:\n" + "\n".join(missing)


def test_path_check_sees_missing_paths(tmp_path):
    text = ("`stages/leaves/config.py` and `stages/no_such_module.py: run()`, [a page](guide/none.md), "
            "`stages/compute/models/<arch>.py` (a placeholder)\n```\n.venv/bin/python bench/no_such_bench.py --help\n"
            "python bench/<name>.py\n```\n")
    names = [(written, path.exists()) for written, path, _ in named_paths(tmp_path / "page.md", text)]
    assert names == [(".venv/bin/python bench/no_such_bench.py --help", False), ("stages/leaves/config.py", True),
                     ("stages/no_such_module.py: run()", False), ("guide/none.md", False)]


def test_readme_fits_one_reading():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme) <= README_LIMIT, f"README.md has {len(readme):,} characters, more than {README_LIMIT:,}"
    assert "../" not in readme, "README.md refers outside the repository"
    for command in ("make demo", "make test"):
        assert command in readme[:3000], f"README.md's first screen lacks `{command}`"
