"""Print the package's shape: longest functions, largest modules, docstring share.

Usage: python scripts/code_shape.py [ROOT=pddgw] [--top N] [--json]
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _docstring_lines(tree: ast.AST) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                n += body[0].end_lineno - body[0].lineno + 1
    return n


def shape(root: Path) -> dict:
    functions, modules, doc, total, long_docs = [], [], 0, 0, []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        total += lines
        doc += _docstring_lines(tree)
        modules.append((lines, str(path)))
        mdoc = ast.get_docstring(tree, clean=False)
        if mdoc and mdoc.count("\n") + 1 > 25:
            long_docs.append((mdoc.count("\n") + 1, str(path)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
    return {"lines": total, "docstring_lines": doc, "docstring_share": round(doc / total, 4),
            "functions": sorted(functions, reverse=True), "modules": sorted(modules, reverse=True),
            "module_docstrings_over_25": sorted(long_docs, reverse=True)}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 15
    if "--top" in sys.argv:
        args.remove(str(top))
    s = shape(Path(args[0] if args else "pddgw"))
    if "--json" in sys.argv:
        print(json.dumps({**s, "functions": s["functions"][:top], "modules": s["modules"][:top]}, indent=1))
        return
    print(f"{s['lines']} lines, docstrings {s['docstring_lines']} ({100 * s['docstring_share']:.1f} %)")
    print(f"\nlongest {top} functions:")
    for n, where in s["functions"][:top]:
        print(f"  {n:5d}  {where}")
    print(f"\nlargest {top} modules:")
    for n, where in s["modules"][:top]:
        print(f"  {n:5d}  {where}")
    print(f"\nmodule docstrings over 25 lines: {len(s['module_docstrings_over_25'])}")
    for n, where in s["module_docstrings_over_25"]:
        print(f"  {n:5d}  {where}")


if __name__ == "__main__":
    main()
