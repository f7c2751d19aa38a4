"""The step runner: executes a pattern's steps between deploys, safely and resumably.

Library entry points mirror the CLI: `Runner(dsn, settings, pattern)` then `.run(to_phase)`,
`.next()`, `.status()`, `.verify()`, `.rollback(to_phase)`, `.reset()`.
"""

from outbox_migrate.runner.engine import Runner, RunResult

__all__ = ["RunResult", "Runner"]
