"""`python -m outbox_migrate` runs the same CLI as the `outbox-migrate` console script."""

from outbox_migrate.cli.app import main

if __name__ == "__main__":  # the guard keeps spawned worker processes from re-running the CLI
    main()
