"""`python -m outbox_migrate` runs the same CLI as the `outbox-migrate` console script.

Only the launcher is imported here: it installs the signal handlers before anything heavy.
"""

from outbox_migrate.cli.launch import main

if __name__ == "__main__":  # the guard keeps spawned worker processes from re-running the CLI
    main()
