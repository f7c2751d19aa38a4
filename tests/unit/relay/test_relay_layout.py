"""The polling relay's parts stay small and import each other one way only (read from the
source, as tests/unit/test_runner_layers.py does for the runner): the worker used to be one
1,488-line module whose parts called each other through `self`."""

from __future__ import annotations

from tests.unit.test_runner_layers import MAX_LINES, ROOT, _graph, _reaches

PARTS = (
    "worker", "driver", "batch_loop", "batch", "shared", "refusals", "run_stats",
    "idle_flag", "waits", "wire", "read_ahead",
)  # fmt: skip


def test_no_relay_module_over_600_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for path in (ROOT / "relay").rglob("*.py")
    }
    over = {name: size for name, size in sizes.items() if size > MAX_LINES}
    assert not over, over


def test_the_workers_parts_are_on_no_import_circle() -> None:
    graph = _graph()
    names = [f"outbox_migrate.relay.{part}" for part in PARTS]
    circles = [name for name in names if _reaches(graph, name, name)]
    assert not circles, circles


def test_a_worker_never_imports_the_relays_lifecycle() -> None:
    """Workers see their relay through `Shared` (relay/shared.py), never `Relay` itself."""
    graph = _graph()
    lifecycle = "outbox_migrate.relay.worker"
    below = [f"outbox_migrate.relay.{p}" for p in PARTS if p != "worker"]
    reaching = [name for name in below if _reaches(graph, name, lifecycle)]
    assert not reaching, reaching
