"""The house keeps its floors: imports point down only, no cycles, modules and classes stay small.

Every import counts: at module level, inside functions and under `TYPE_CHECKING`. The rows are
DESIGN.md §3's; docs/architecture.md explains them.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mirrored"

# Bottom to top. A module imports only from its own folder or a lower row; folders on one row
# never import each other. The single-file modules at the package root are one folder (row 8:
# the public façades, re-exports only) except the command line (row 9).
ROWS = [
    {"_core"},
    {"_nnx", "_optim", "_persist"},
    {"_run", "_data"},
    {"_strategy"},
    {"_proof", "_cluster"},
    {"_train"},
    {"keras"},
    {"<façades>"},
    {"_cli"},  # and cli.py, the command's entry point
]
FAÇADES = {
    "__init__",
    "callbacks",
    "config",
    "debug",
    "layers",
    "losses",
    "metrics",
    "mixed_precision",
    "_keras_autoload",
}
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def folder_of(module: str) -> str:
    """`mirrored._run.runner` -> `_run`; `mirrored.callbacks` -> `<façades>`."""
    parts = module.split(".")
    if len(parts) == 1:
        return "<façades>"
    if len(parts) == 2 and parts[1] in FAÇADES:
        return "<façades>"
    return "_cli" if parts[1] == "cli" else parts[1]


def row_of(folder: str) -> int:
    for i, row in enumerate(ROWS):
        if folder in row:
            return i
    raise AssertionError(
        f"Expected every module of mirrored in a row of tests/test_layers.py ROWS; found the "
        f"folder {folder!r} in none. Fix: add it to the row it belongs to (DESIGN.md §3)."
    )


def imports(root: Path) -> dict[str, set[str]]:
    """Every mirrored module each module imports, wherever the import statement stands."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                candidates = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in modules:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name:
                    targets.add(candidate)
                    break
        found[name] = targets
    return found


def violations(root: Path) -> list[str]:
    """Upward imports, imports across one row, and façades imported by private modules."""
    bad = []
    for module, targets in imports(root).items():
        folder = folder_of(module)
        for target in sorted(targets):
            to = folder_of(target)
            if to == folder:
                continue
            if row_of(to) > row_of(folder):
                bad.append(
                    f"{module} imports {target}: upward (row {row_of(to) + 1} above row "
                    f"{row_of(folder) + 1})"
                )
            elif row_of(to) == row_of(folder):
                bad.append(f"{module} imports {target}: across one row ({folder} and {to})")
    return bad


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = imports(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_only():
    assert violations(SRC) == []


def test_no_import_cycles():
    assert cycles(SRC) == []


def test_sizes():
    too_long = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_long.append(f"{rel}: class {node.name}, {size} lines")
    assert too_long == [], f"split by concept (at most {MAX_MODULE_LINES} / {MAX_CLASS_LINES})"


@pytest.mark.parametrize(
    ("module", "statement", "found"),
    [
        ("_core/mesh.py", "from mirrored._run import runner", "upward"),
        ("_core/mesh.py", "    from mirrored import metrics", "upward"),  # lazy, too
        ("_run/dispatch.py", "from mirrored._data import batching", "across one row"),
        ("_nnx/rnn.py", "from mirrored.keras import _bind", "upward"),
    ],
)
def test_a_planted_import_is_caught(tmp_path, module, statement, found):
    root = tmp_path / "mirrored"
    for path in SRC.rglob("*.py"):
        target = root / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    planted = root / module
    body = statement if not statement.startswith(" ") else f"def _f():\n{statement}\n"
    planted.write_text(planted.read_text() + "\n" + body + "\n")
    assert any(found in v and module.replace("/", ".")[:-3] in v for v in violations(root))


def test_a_planted_cycle_is_caught(tmp_path):
    root = tmp_path / "mirrored"
    for path in SRC.rglob("*.py"):
        target = root / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    guard = root / "_run" / "guard.py"
    guard.write_text(guard.read_text() + "\nif False:\n    from mirrored._run import runner\n")
    assert ["mirrored._run.guard", "mirrored._run.runner"] in [
        [m for m in c if m in ("mirrored._run.guard", "mirrored._run.runner")] for c in cycles(root)
    ]
