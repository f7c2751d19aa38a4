"""The whole package holds the two layout rules the runner's and the relay's own tests check
for their parts: no import circle anywhere (function-level and TYPE_CHECKING imports count:
a circle hidden in a function is still a circle) and no module over 600 lines."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.unit.test_runner_layers import MAX_LINES, _graph, _modules, _reaches


def test_no_import_circle_in_the_package() -> None:
    graph = _graph()
    circles = sorted(m for m in graph if _reaches(graph, m, m))
    assert not circles, circles


def test_no_module_of_the_package_over_600_lines() -> None:
    long = {
        name: lines
        for name, path in _modules().items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


PACKAGE = "outbox_migrate."
BASE_MODULES = ("config", "errors", "db", "dsn", "backoff", "lock_budget", "sql_layout")
NEVER = [
    # (who, what it must never reach at import time)
    (("patterns",), ("relay", "runner", "jobs", "cli")),
    (("relay",), ("runner", "cli", "advisory")),
    (("advisory.introspect",), ("runner",)),
    (BASE_MODULES, ("patterns",)),
]


def _runtime_imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What importing `name` imports at once: module-level imports (not those under
    `if TYPE_CHECKING:` nor inside functions), and every parent package of each of them —
    importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first."""

    def walk(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node
            elif isinstance(node, ast.If):
                test = node.test
                checking = getattr(test, "id", getattr(test, "attr", "")) == "TYPE_CHECKING"
                yield from walk(node.orelse if checking else node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body + node.orelse + node.finalbody)

    found: set[str] = set()
    for node in walk(ast.parse(path.read_text(encoding="utf-8")).body):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    with_parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 2)}
    own_parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return (with_parents | own_parents) & known.keys() - {name}


def _runtime_graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _runtime_imports(name, path, known) for name, path in known.items()}


def _inside(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == PACKAGE + r or module.startswith(PACKAGE + r + ".") for r in rooms)


def test_the_layers_hold_counting_the_parent_packages_an_import_runs() -> None:
    graph = _runtime_graph()
    broken = []
    for sources, targets in NEVER:
        for module in sorted(m for m in graph if _inside(m, sources)):
            reached = sorted(m for m in graph if _inside(m, targets) and _reaches(graph, module, m))
            if reached:
                broken.append(f"{module} reaches {reached[0]}")
    assert not broken, broken


def test_no_import_circle_between_subpackages_at_import_time() -> None:
    """A circle between rooms (relay ↔ patterns, say) through any module of each, parents
    counted: the rooms must stack."""
    graph = _runtime_graph()

    def room(module: str) -> str:
        return module.removeprefix(PACKAGE).split(".")[0] if module != "outbox_migrate" else ""

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets)
    for name, targets in rooms.items():
        targets.discard(name)
        targets.discard("")
    circles = sorted(r for r in rooms if r and _reaches(rooms, r, r))
    assert not circles, circles


def _every_import() -> Iterator[tuple[str, list[str]]]:
    """(module, the absolute modules one of its import statements names), for every import
    statement of the package: at import time, in a function or under TYPE_CHECKING."""
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                yield name, [node.module]
            elif isinstance(node, ast.Import):
                yield name, [a.name for a in node.names]


HARNESS = "outbox_migrate_harness"
HARNESS_USERS = ("cli.demo_cmd", "rehearse")


def test_only_demo_and_rehearse_use_the_proof_harness() -> None:
    """The harness is a distribution of its own (harness/, docs/demo.md): a production install
    has none, so no other module may import it, at import time or in a function."""
    users = []
    for name, targets in _every_import():
        if any(t.split(".")[0] == HARNESS for t in targets) and not _inside(name, HARNESS_USERS):
            users.append(f"{name} imports {targets[0]}")
    assert not users, users
    assert not (Path("outbox_migrate") / "sim").exists()
    assert not (Path("outbox_migrate") / "testing").exists()


def test_no_layer_is_crossed_by_an_import_inside_a_function_either() -> None:
    """An import in a function runs too, only later: every import a module writes keeps to
    the layers (type-only imports included: they name what the module depends on)."""
    broken = []
    for name, targets in _every_import():
        for sources, forbidden in NEVER:
            if _inside(name, sources) and any(_inside(t, forbidden) for t in targets):
                broken.append(f"{name} imports {targets[0]}")
    assert not broken, broken
