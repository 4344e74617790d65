"""The layering is a rule: import-linter checks the contracts of ``pyproject.toml``
(``[tool.importlinter]``: the layers, algos without megatron, megatron-core only in the megatron
layer and the NeMo-Aligner path, no import cycles), and two checks import-linter cannot express
run here: no ``torch.distributed`` above the megatron layer and megatron-core's parallel_state
read only through ``quatro_nemo.megatron.parallel`` (import-linter forbids only whole external
packages), and recipes/ (scripts, not a package) importing only public quatro_nemo names."""
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "quatro_nemo"
# Packages that reach the process groups only through quatro_nemo.megatron (parallel, collectives).
ABOVE_MEGATRON = ("algos", "data", "rewards", "eval", "tasks", "engine", "study")


def test_import_linter_contracts_are_kept():
    try:
        import importlinter  # noqa: F401
    except ImportError:
        pytest.fail("import-linter is missing: pip install -r requirements/test.txt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + sys.path))
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command(['--no-cache']))"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout, result.stdout


def _imports(path: Path) -> Iterator[Tuple[int, str]]:
    """(line, dotted name) of every module or attribute an import statement names, at any depth
    (function-level imports included)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def _uses_torch_distributed(path: Path) -> Iterator[int]:
    for line, name in _imports(path):
        if name == "torch.distributed" or name.startswith("torch.distributed."):
            yield line
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "distributed"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            yield node.lineno


@pytest.mark.parametrize("package", ABOVE_MEGATRON)
def test_no_torch_distributed_above_the_megatron_layer(package):
    offenders = [f"{path.relative_to(REPO)}:{line}"
                 for path in sorted((PACKAGE / package).rglob("*.py")) for line in _uses_torch_distributed(path)]
    assert not offenders, (f"quatro_nemo.{package} uses torch.distributed directly; call "
                           f"quatro_nemo.megatron.parallel / collectives instead: {offenders}")


def test_only_megatron_parallel_reads_megatron_parallel_state():
    """Ranks, sizes and groups come from quatro_nemo.megatron.parallel's wrappers."""
    wrapper = PACKAGE / "megatron" / "parallel.py"
    offenders = [f"{path.relative_to(REPO)}:{line}" for path in sorted(PACKAGE.rglob("*.py")) if path != wrapper
                 for line, name in _imports(path) if name == "megatron.core.parallel_state"]
    assert not offenders, f"use quatro_nemo.megatron.parallel instead: {offenders}"


def _module_exists(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_recipes_import_only_public_quatro_nemo_modules():
    """recipes/ sit on top of every layer and may import any of it, but only what exists and
    is public (no ``_private`` module or name)."""
    recipes = sorted((REPO / "recipes").glob("*.py"))
    assert recipes
    offenders = []
    for path in recipes:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("quatro_nemo"):
                modules, names = [node.module], [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names if a.name.startswith("quatro_nemo")], []
            else:
                continue
            for module in modules:
                private = [part for dotted in [module] + names for part in dotted.split(".") if part.startswith("_")]
                if not _module_exists(module) or private:
                    offenders.append(f"{path.name}:{node.lineno}: {module} {names}")
    assert not offenders, offenders
