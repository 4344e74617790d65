"""Program normalisation behind the code-aware near-duplicate criterion for UCC@k on code
benchmarks (``quatro_nemo.eval.similarity``'s ``code`` metric and ``cluster_code_solutions``).

Two programs that differ only in identifier names, comments, docstrings, blank lines, quoting or
redundant parentheses are the same solution. Each program is normalised through Python's own
parser before comparison:

1. ``ast.parse`` (comments and layout disappear);
2. docstrings removed (a string-constant statement first in a module, class or function);
3. identifiers bound in the program (variables, arguments, functions, classes, loop targets,
   comprehension variables) renamed to ``v0, v1, ...`` in order of first appearance; builtins,
   imported names and attribute names are kept (``math.sqrt`` stays ``math.sqrt``);
4. ``ast.unparse`` gives one canonical text.

Similarity is ROUGE-L F1 over the tokens of the normalised texts (quatro_nemo.eval.similarity's
``rouge_l``: 2 LCS / (|a| + |b|), Lin 2004), so reordered statements or a changed expression
lower it gradually. The idea of comparing normalised ASTs / identifier-anonymised token streams
follows clone detection practice (Roy, Cordy & Koschke 2009, "type-2 clones": identical up to
identifiers, literals aside, layout and comments). A program that does not parse is compared on
its whitespace-collapsed text.
"""
from __future__ import annotations

import ast
import builtins
from typing import Dict

from quatro_nemo.rewards.code import extract_code

_BUILTIN_NAMES = frozenset(dir(builtins))


class _Anonymiser(ast.NodeTransformer):
    """Rename program-bound identifiers to v0, v1, ... in order of first appearance."""

    def __init__(self, kept: frozenset):
        self.kept = kept
        self.names: Dict[str, str] = {}

    def _rename(self, name: str) -> str:
        if name in self.kept:
            return name
        if name not in self.names:
            self.names[name] = f"v{len(self.names)}"
        return self.names[name]

    def visit_Name(self, node: ast.Name) -> ast.AST:
        node.id = self._rename(node.id)
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.arg = self._rename(node.arg)
        node.annotation = None                      # type hints are not part of the solution
        return node

    def _visit_def(self, node):
        node.name = self._rename(node.name)
        if hasattr(node, "returns"):
            node.returns = None
        _drop_docstring(node)
        self.generic_visit(node)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_def


def _drop_docstring(node) -> None:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]


def _imported_names(tree: ast.AST) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.add((alias.asname or alias.name).split(".")[0])
    return names


def normalize_code(source: str) -> str:
    """Canonical text of a Python program (see the module docstring); collapsed whitespace if
    it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return " ".join(source.split())
    _drop_docstring(tree)
    kept = frozenset(_BUILTIN_NAMES | _imported_names(tree))
    tree = ast.fix_missing_locations(_Anonymiser(kept).visit(tree))
    return ast.unparse(tree)


def normalized_program(response: str) -> str:
    """The canonical text of the program in a response (code extracted from markdown fences
    as for grading, then normalize_code)."""
    return normalize_code(extract_code(response))
