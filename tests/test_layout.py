"""The house's layout: a function in flows/ or stages/ fits one reading (80 lines at most, its
decorators, signature and docstring included); a longer one is several steps to name apart. The
tag names written on MLflow runs stand in one place, stages/leaves/tags.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from stages.leaves.config import REPO_ROOT

MOST_LINES = 80


def long_functions(root: Path, packages=("flows", "stages")) -> list[str]:
    """`path:line name (N lines)` for each function or method longer than MOST_LINES."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    lines = node.end_lineno - first + 1
                    if lines > MOST_LINES:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_flows_or_stages_is_longer_than_80_lines():
    assert long_functions(REPO_ROOT) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "stages").mkdir()
    body = "".join(f"    x{k} = {k}\n" for k in range(MOST_LINES))
    (tmp_path / "stages" / "long.py").write_text(f"def short():\n    return 1\n\n\n@staticmethod\ndef long():\n{body}")
    assert long_functions(tmp_path) == [f"stages/long.py:6 long ({MOST_LINES + 2} lines)"]


TAG_NAME = re.compile(r"rlhf\.[a-z_]+")


def tag_literals(root: Path, packages=("flows", "stages", "data_contracts")) -> list[str]:
    """`path:line 'text'` for each string in code (not a docstring) that starts with a tag name,
    outside stages/leaves/tags.py."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.relative_to(root) == Path("stages/leaves/tags.py"):
                continue
            tree = ast.parse(path.read_text())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and node.body and isinstance(node.body[0], ast.Expr)}
            found += [f"{path.relative_to(root)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                      and TAG_NAME.match(node.value)]
    return found


def test_tag_names_are_named_once_in_stages_tags():
    assert tag_literals(REPO_ROOT) == []


def test_the_tag_check_sees_a_literal_tag(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "champion.py").write_text('"""Sets rlhf.champion."""\n\nTAGS = {"rlhf.champion": "yes"}\n')
    assert tag_literals(tmp_path) == ["stages/champion.py:3 'rlhf.champion'"]
