"""The house plan (docs/DESIGN.md, "Layers"), checked on the source tree so it stays true:

* every import inside the project points down the layers and no two modules import each other,
  even lazily (function-level imports count);
* ``python_engines`` imports only public names of ``awex_fast`` (a package's ``_EXPORTS``);
* no source file over 600 lines and no function over 80, in Python and in C++;
* one definition of the admin key's environment variable, and no pickle anywhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("awex_fast", "python_engines")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

#: awex_fast's packages from the bottom up: a module may import its own package and lower layers.
LAYERS = {
    "_native": 0, "_lazy": 0, "_C": 0,
    "meta": 1,
    "layouts": 2, "plan": 2,
    "transport": 3, "net": 3,
    "transfer": 4,
    "sync": 5,
    "vllm": 6,
    "bench": 7, "cli": 7,
}  # fmt: skip


def _sources() -> dict[str, Path]:
    """Dotted module name -> file, for every Python module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


SOURCES = _sources()


def _imports(module: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every import statement, at any depth."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((base, [alias.name for alias in node.names], node.lineno))
    return found


def _project_targets(target: str, names: list[str]) -> list[str]:
    """The project modules an import statement loads (``from pkg import mod`` loads ``pkg.mod``)."""
    hits = [target] if target in SOURCES else []
    hits += [f"{target}.{n}" for n in names if f"{target}.{n}" in SOURCES]
    return hits


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in SOURCES.items():
        edges = set()
        for target, names, _ in _imports(module, path):
            for hit in _project_targets(target, names):
                # importing one's own ancestor package is how a subpackage reaches its siblings
                if hit != module and not module.startswith(hit + "."):
                    edges.add(hit)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _layer(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if parts[0] != "awex_fast" or len(parts) == 1:
        return None
    return parts[1], LAYERS[parts[1]]


def test_imports_point_down_the_layers():
    wrong = []
    for module, edges in _graph().items():
        if module.startswith("awex_fast") and any(e.startswith("python_engines") for e in edges):
            wrong.append(f"{module} imports python_engines")
        mine = _layer(module)
        for target in edges:
            theirs = _layer(target)
            if mine is None or theirs is None or mine[0] == theirs[0]:
                continue
            if theirs[1] >= mine[1]:
                wrong.append(f"{module} ({mine[0]}, layer {mine[1]}) imports {target} "
                             f"({theirs[0]}, layer {theirs[1]})")
    assert wrong == []


def _exports(package: str) -> set[str]:
    """A package's public names: its ``_EXPORTS`` keys, or its ``__all__``."""
    tree = ast.parse(SOURCES[package].read_text())
    for node in tree.body:
        assigned = getattr(node, "targets", [getattr(node, "target", None)])
        targets = [t.id for t in assigned if isinstance(t, ast.Name)]
        if "_EXPORTS" in targets and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts}
    return set()


def test_python_engines_use_only_public_names():
    private = []
    for module, path in SOURCES.items():
        if not module.startswith("python_engines"):
            continue
        for target, names, line in _imports(module, path):
            if not target.startswith("awex_fast"):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if target.count(".") > 1 or target not in SOURCES:
                private.append(f"{where}: imports module {target}")
                continue
            hidden = [n for n in names if n not in _exports(target) and f"{target}.{n}" not in SOURCES]
            if hidden:
                private.append(f"{where}: {target} does not export {hidden}")
    assert private == []


def _python_files() -> list[Path]:
    return sorted(p for d in (*PACKAGES, "examples", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py"))


def test_python_files_and_functions_are_small():
    long = []
    for path in _python_files():
        text = path.read_text()
        lines = text.count("\n") + 1
        rel = path.relative_to(ROOT)
        if lines > MAX_FILE_LINES and rel.parts[0] != "tests":
            long.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > MAX_FUNCTION_LINES and not node.name.startswith("test_"):
                    long.append(f"{rel}:{node.lineno} {node.name}: {span} lines")
    assert long == []


_SIGNATURE = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(->\s*[\w:<>, ]+\s*)?$")
_NOT_FUNCTION = re.compile(
    r"^\s*(namespace|struct|class|enum|union|extern|if|for|while|switch|else|do|try)\b")


def _cpp_functions(text: str) -> list[tuple[str, int, int]]:
    """(signature line, first line, length) of every function body in C++ source, found by brace
    depth: a ``{`` whose statement text ends like a signature (``... )``, ``) const``) opens one."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    code = re.sub(r'"(\\.|[^"\\])*"' + r"|'(\\.|[^'\\])*'", lambda m: " " * len(m.group()), code)
    found, opened, statement, depth, line = [], [], "", 0, 1
    for ch in code:
        if ch == "\n":
            line += 1
        if ch == "{":
            head = " ".join(statement.split())
            is_function = (bool(_SIGNATURE.search(head)) and not _NOT_FUNCTION.match(head)
                           and "=" not in head.split("(")[0])
            opened.append((is_function and not any(f for f, _, _ in opened), head, line))
            depth += 1
            statement = ""
        elif ch == "}":
            depth -= 1
            is_function, head, start = opened.pop()
            if is_function:
                found.append((head[-80:], start, line - start + 1))
            statement = ""
        elif ch == ";":
            statement = ""
        else:
            statement += ch
    return found


def test_cpp_files_and_functions_are_small():
    long = []
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".cpp", ".h", ".cu", ".cuh"):
            continue
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{rel}: {text.count(chr(10))} lines")
        long += [f"{rel}:{start} {head!r}: {span} lines" for head, start, span in _cpp_functions(text)
                 if span > MAX_FUNCTION_LINES]
    assert long == []


def test_the_cpp_function_finder_sees_functions():
    # the size check above is only as good as this parser: it must find real bodies in real files
    text = (ROOT / "csrc" / "bindings.cpp").read_text()
    assert _cpp_functions(text), "no function found in csrc/bindings.cpp"
    sample = ("int f(int a) {\n  if (a) {\n    return 1;\n  }\n  return 0;\n}\n"
              "struct S { int g() const { return 1; } };\n")
    assert [(start, span) for _, start, span in _cpp_functions(sample)] == [(1, 6), (7, 1)]


def test_admin_key_variable_is_defined_once():
    defined = [str(path.relative_to(ROOT)) for path in _python_files()
               if path.parts[-2] != "tests" and "tests" not in path.relative_to(ROOT).parts
               and '"AWEX_FAST_ADMIN_KEY"' in path.read_text()]
    assert defined == ["awex_fast/net/kvstore.py"]


@pytest.mark.parametrize("package", [*PACKAGES, "examples", "benchmarks"])
def test_no_pickle(package):
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                      for n in names if n.split(".")[0] in banned]
    assert found == []
