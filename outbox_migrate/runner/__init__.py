"""The step runner: executes a pattern's steps between deploys, safely and resumably
(docs/runner.md).
"""

from outbox_migrate.runner.engine import Runner, RunResult

__all__ = ["RunResult", "Runner"]
