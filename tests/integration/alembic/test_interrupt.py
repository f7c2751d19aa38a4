"""Ctrl-C during an online `alembic upgrade` (the V3 gate, which samples for its window):
one `FAILED:` line instead of a KeyboardInterrupt traceback, and nothing recorded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
from alembic import command
from outbox_migrate_harness.testing.schema import create_flat_outbox

from outbox_migrate.alembic_ext.generate import generate
from outbox_migrate.config import load_settings
from tests.support.alembic_project import config_for, sqlalchemy_url, version_of


def test_ctrl_c_in_the_gate_is_one_failed_line(project_per_migration: Path, dsn: str) -> None:
    ini = project_per_migration
    targets = generate("hop", load_settings({}, environ={}), ini.parent, tag="k1").phase_targets
    url = sqlalchemy_url(dsn).replace("%", "%%")
    ini.write_text(
        re.sub(r"(?m)^sqlalchemy\.url = .*$", f"sqlalchemy.url = {url}", ini.read_text())
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        create_flat_outbox(conn)
        command.upgrade(config_for(ini, dsn), targets["V2"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_MIGRATE_")}
        env["OUTBOX_MIGRATE_GATE_WINDOW_S"] = "60"
        upgrade = subprocess.Popen(
            [sys.executable, "-m", "alembic", "-c", str(ini), "upgrade", targets["V3"]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start:
            # the alembic command installs no handler of its own, as a terminal's would not.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not conn.execute(
                "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid() AND datname = current_database()"
            ).fetchone():
                assert time.monotonic() < deadline, "the upgrade never connected"
                time.sleep(0.2)
            time.sleep(6)  # into the gate's sampling window (60 s), past Alembic's start
            upgrade.send_signal(signal.SIGINT)
            out, err = upgrade.communicate(timeout=60)
        finally:
            upgrade.kill()
        assert upgrade.returncode == 255, err
        assert "Traceback" not in err, err
        failed = [line for line in out.splitlines() if "FAILED" in line]
        assert len(failed) == 1, out
        assert failed[0].startswith("FAILED: interrupted (Ctrl-C) during step hop.v3.gate"), out
        assert version_of(conn) == targets["V2"]
