"""The import rule (pyproject.toml [tool.importlinter]): imports go down the layers, one folder of
stages/ each: flows → data contracts → stage modules → what stages run on → running and recording
stages → what the stages compute with → leaf modules; no leaf imports another, and no modules
import one another in a circle. import-linter checks the layers, grimp the circles."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

from stages.leaves.config import REPO_ROOT

PACKAGES = ("flows", "stages", "data_contracts")
CONTRACTS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's CLI on the packages under `root`, with the contract in its pyproject.toml."""
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                                                 "lint_imports_command()", "--no-cache"],
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)


def test_imports_go_down_the_layers():
    result = lint_imports(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


@pytest.mark.parametrize(("module", "planted", "broken"), [
    # a leaf module reaching up into the stage table it parameterises
    ("stages/leaves/config.py", "from stages.orchestration import registry", "stages.leaves.config -> stages.orchestration.registry"),
    # a shared room reaching up into a stage module
    ("stages/compute/training.py", "from stages.pipeline.sft import run", "stages.compute.training -> stages.pipeline.sft"),
    # a stage module reaching for the launcher instead of taking its Dist from stages.leaves.dist
    ("stages/pipeline/sft.py", "from stages.orchestration.launch import Dist", "stages.pipeline.sft -> stages.orchestration.launch"),
    ("stages/runtime/lifecycle.py", "from stages.orchestration.launch import Dist", "stages.runtime.lifecycle -> stages.orchestration.launch"),
    # a stage module reaching into another stage module for what they share
    ("stages/pipeline/critic.py", "from stages.pipeline.reward import encode_pairs",
     "stages.pipeline.critic -> stages.pipeline.reward"),
    ("stages/pipeline/best_of_n.py", "from stages.pipeline.ppo import encode_prompts",
     "stages.pipeline.best_of_n -> stages.pipeline.ppo"),
    # the reward server reaching into the data stage for what stages.leaves.rendering holds
    ("stages/compute/reward/serve.py", "from stages.pipeline.data import read_jsonl",
     "stages.compute.reward.serve -> stages.pipeline.data"),
    # a leaf, the same
    ("stages/leaves/rendering.py", "from stages.pipeline.data import SPLITS", "stages.leaves.rendering -> stages.pipeline.data"),
    # a leaf reaching for another leaf
    ("stages/leaves/stats.py", "from stages.leaves import config", "stages.leaves.stats -> stages.leaves.config"),
])
def test_a_planted_import_breaks_the_rule(tmp_path, module, planted, broken):
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0  # the copy keeps the rule
    path = tmp_path / module
    text = path.read_text()
    first_import = text.index("\nfrom __future__ import annotations\n") + len("\nfrom __future__ import annotations")
    path.write_text(f"{text[:first_import]}\n{planted}{text[first_import:]}")
    result = lint_imports(tmp_path)
    counts = re.search(r"Contracts: (\d+) kept, (\d+) broken\.", result.stdout)
    assert result.returncode == 1 and counts, result.stdout + result.stderr
    kept, broken_contracts = map(int, counts.groups())  # an import up into a stage module can break two
    assert broken_contracts >= 1 and kept + broken_contracts == len(CONTRACTS)
    assert broken in result.stdout


def test_no_modules_import_each_other_in_a_circle(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    imports = [(importer, imported) for importer in graph.modules
               for imported in graph.find_modules_directly_imported_by(importer)]
    assert len(imports) > 150  # the graph was built from this checkout's packages
    circles = [" -> ".join((importer, *graph.find_shortest_chain(importer=imported, imported=importer)))
               for importer, imported in imports if graph.chain_exists(importer=imported, imported=importer)]
    assert circles == []


def _deferred_imports_without_a_reason(path: Path) -> list[str]:
    """The first import of each run of imports inside a function, where neither its line nor the
    line above it has a comment."""
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for block in ast.walk(function):
            for field in ("body", "orelse", "finalbody", "handlers"):
                statements = getattr(block, field, None)
                if not isinstance(statements, list):
                    continue
                for before, statement in zip([None, *statements], statements):
                    first_of_a_run = isinstance(statement, (ast.Import, ast.ImportFrom)) and not isinstance(
                        before, (ast.Import, ast.ImportFrom))
                    line = statement.lineno
                    if first_of_a_run and "#" not in lines[line - 1] and not lines[line - 2].lstrip().startswith("#"):
                        found.append(f"{path.relative_to(REPO_ROOT)}:{line}: {lines[line - 1].strip()}")
    return found


def test_a_function_local_import_says_why_it_is_deferred():
    """Imports sit at the top of a module; one inside a function defers a heavy library (torch,
    MLflow, Prefect, Great Expectations, ...) and says so, so it hides no circle."""
    missing = [where for package in PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))
               for where in _deferred_imports_without_a_reason(path)]
    assert missing == []


def test_every_module_has_a_layer(monkeypatch):
    """A new module goes into a layer of the contract: a folder of stages/ is one layer, and only
    the package that holds the layers stands outside them."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    contract = _contract(type="layers")
    layers = {name.strip().strip("()") for layer in contract["layers"] for name in re.split(r"[|:]", layer)}
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    outside = {module for module in graph.modules
               if not any(module == layer or module.startswith(f"{layer}.") for layer in layers)}
    assert outside == {"stages"}


def _contract(**fields: object) -> dict:
    """The one contract of pyproject.toml whose fields have these values."""
    (contract,) = [c for c in CONTRACTS if all(c.get(key) == value for key, value in fields.items())]
    return contract


# What reads the data stage's splits: the flows, the stage modules and their contracts.
DATA_STAGE_READERS = ("flows", "data_contracts", "stages.pipeline")


def test_every_other_module_is_kept_from_the_data_stage(monkeypatch):
    """A new module that is not a stage, a contract or a flow is a source module of the forbidden
    contract: it renders and encodes text with stages.leaves.rendering, not the data stage."""
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    sources = _contract(forbidden_modules=["stages.pipeline.data"])["source_modules"]
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    unguarded = {module for module in graph.modules
                 if not any(module == name or module.startswith(f"{name}.") for name in (*sources, *DATA_STAGE_READERS))}
    assert unguarded == {"stages"}
