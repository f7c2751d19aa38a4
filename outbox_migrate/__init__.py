"""outbox-migrate: move a live PostgreSQL outbox to a LIST-partitioned table, then run it.

Importing the package must stay cheap: `outbox-migrate --help` loads it, so nothing here may
import psycopg, rich or SQLAlchemy.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("outbox-migrate")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
