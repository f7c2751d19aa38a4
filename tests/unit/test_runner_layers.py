"""The runner's parts import each other one way only, and the lock budget sits below the
runner, the jobs and the relay: read from the source (function-level and TYPE_CHECKING
imports count too — a circle hidden in a function is still a circle)."""

from __future__ import annotations

import ast
from pathlib import Path

import outbox_migrate

ROOT = Path(outbox_migrate.__file__).resolve().parent
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of ours `path` imports (`from pkg import submodule` counts as the submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            found |= subs if len(subs) == len(node.names) else subs | {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & known.keys()


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(path, known) - {name} for name, path in known.items()}


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return False


def test_no_import_circle_through_the_runner() -> None:
    graph = _graph()
    runner = [m for m in graph if m.startswith("outbox_migrate.runner.")]
    circles = [m for m in runner if _reaches(graph, m, m)]
    assert not circles, circles


def test_the_lock_budget_is_below_runner_jobs_and_relay() -> None:
    graph = _graph()
    above = ("outbox_migrate.runner", "outbox_migrate.jobs", "outbox_migrate.relay")
    reached = [
        m for m in graph if m.startswith(above) and _reaches(graph, "outbox_migrate.lock_budget", m)
    ]
    assert not reached, reached
    relay_up = [
        m for m in graph["outbox_migrate.relay.switching"] if m.startswith("outbox_migrate.runner")
    ]
    assert not relay_up, relay_up


def test_no_runner_module_over_600_lines() -> None:
    sizes = {
        path.name: len(path.read_text(encoding="utf-8").splitlines())
        for path in (ROOT / "runner").glob("*.py")
    }
    assert all(size <= MAX_LINES for size in sizes.values()), sizes
