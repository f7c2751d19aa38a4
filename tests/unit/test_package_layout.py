"""The whole package holds the two layout rules the runner's and the relay's own tests check
for their parts: no import circle anywhere (function-level and TYPE_CHECKING imports count:
a circle hidden in a function is still a circle) and no module over 600 lines."""

from __future__ import annotations

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
