"""The package's layout rules, read from its source with ``ast``: imports run one way (``io/`` and
``exactness/`` below ``models/``, ``decoding/`` and ``server/``), no import cycles (imports inside
functions and under ``TYPE_CHECKING`` count), no underscore name taken from another mlx_mtp
module, module docstrings of at most 15 lines, and no machine figures in package code. Each rule
is also run on a small package that breaks it, so a check that finds nothing is seen to work."""

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

import mlx_mtp

PACKAGE = Path(mlx_mtp.__file__).parent
LOWER = ("io", "exactness")  # subpackages that import no higher layer
HIGHER = ("models", "decoding", "server")
MAX_DOCSTRING_LINES = 15
# The figures of one machine, which go stale (the before-stop hook's pattern): a constant chosen
# by measurement names the benchmark that chose it instead.
MACHINE_FIGURES = re.compile(r"[0-9] ?GB/s|[0-9]-core\b|\bXeon\b|\bEPYC\b|OpenBLAS 0\.[0-9]",
                             re.IGNORECASE)


def modules(root: Path) -> Dict[str, Path]:
    """Dotted module name -> source file, for every .py under the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: Dict[str, Path]) -> List[Tuple[ast.AST, str, tuple]]:
    """``(node, imported module, imported names)`` for every import of ``name``'s source, with
    relative imports resolved and ``from pkg import sub`` read as an import of ``pkg.sub``."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [a.name for a in node.names if f"{base}.{a.name}" in known]
            out += [(node, f"{base}.{s}", ()) for s in subs]
            rest = tuple(a.name for a in node.names if a.name not in subs)
            if rest:
                out.append((node, base, rest))
    return out


def graph(root: Path) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (the package root itself left out: importing
    the public API is not a dependency on a layer)."""
    known = modules(root)
    return {m: {t for _, t, _ in imports(m, p, known) if t in known and t not in (m, root.name)}
            for m, p in known.items() if m != root.name}


def layer_violations(root: Path) -> List[str]:
    out = []
    for m, targets in graph(root).items():
        if m.split(".")[1:2] and m.split(".")[1] in LOWER:
            out += [f"{m} imports {t}" for t in sorted(targets) if t.split(".")[1] in HIGHER]
    return out


def cycles(root: Path) -> List[List[str]]:
    """Each import cycle once, as the modules of a strongly connected component (Tarjan)."""
    g = graph(root)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def private_imports(root: Path) -> List[str]:
    """Underscore names one module takes from another of the package: imported, or read as an
    attribute of an imported package module."""
    known = modules(root)
    out = []
    for m, path in known.items():
        aliases = {}
        for node, target, names in imports(m, path, known):
            if target not in known or target == m:
                continue
            out += [f"{m}: from {target} import {n}" for n in names
                    if n.startswith("_") and not n.startswith("__")]
            for a in node.names:
                if isinstance(node, ast.ImportFrom) and target.endswith("." + a.name):
                    aliases[a.asname or a.name] = target
                elif isinstance(node, ast.Import) and a.asname and a.name == target:
                    aliases[a.asname] = target
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                out.append(f"{m}: {aliases[node.value.id]}.{node.attr}")
    return out


def long_docstrings(root: Path) -> List[str]:
    out = []
    for m, path in modules(root).items():
        body = ast.parse(path.read_text()).body
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            lines = body[0].end_lineno - body[0].lineno + 1
            if lines > MAX_DOCSTRING_LINES:
                out.append(f"{m}: {lines} lines")
    return out


def machine_figures(root: Path) -> List[str]:
    out = []
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".c", ".cpp", ".h"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if MACHINE_FIGURES.search(line):
                    out.append(f"{path.relative_to(root.parent)}:{i}: {line.strip()}")
    return out


def test_io_and_exactness_import_no_higher_layer():
    assert layer_violations(PACKAGE) == []


def test_no_import_cycles():
    assert cycles(PACKAGE) == []


def test_no_module_takes_another_modules_underscore_names():
    assert private_imports(PACKAGE) == []


def test_module_docstrings_are_at_most_15_lines():
    assert long_docstrings(PACKAGE) == []


def test_no_machine_figures_in_package_code():
    assert machine_figures(PACKAGE) == []


@pytest.fixture
def broken(tmp_path) -> Path:
    """A package that breaks every rule once."""
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "io/__init__.py": "",
        "io/files.py": "from pkg.models import loader\n",
        "exactness/__init__.py": "",
        "exactness/probe.py": "def f():\n    from ..decoding import rounds\n",
        "models/__init__.py": "",
        "models/loader.py": "from pkg.models.helpers import _hidden\nfrom pkg.models import helpers\n"
                            "x = helpers._other\n",
        "models/helpers.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                             "    from pkg.decoding.rounds import R\n_hidden = _other = 1\n",
        "decoding/__init__.py": "",
        "decoding/rounds.py": '"""' + "line\n" * 15 + '"""\nfrom pkg.models import helpers\n'
                              "# reads 12 GB/s on a 2-core Xeon\nR = 1\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_each_check_finds_what_breaks_its_rule(broken):
    assert layer_violations(broken) == ["pkg.exactness.probe imports pkg.decoding.rounds",
                                        "pkg.io.files imports pkg.models.loader"]
    assert cycles(broken) == [["pkg.decoding.rounds", "pkg.models.helpers"]]
    assert private_imports(broken) == [
        "pkg.models.loader: from pkg.models.helpers import _hidden",
        "pkg.models.loader: pkg.models.helpers._other"]
    assert long_docstrings(broken) == ["pkg.decoding.rounds: 16 lines"]
    assert machine_figures(broken) == [
        "pkg/decoding/rounds.py:18: # reads 12 GB/s on a 2-core Xeon"]
