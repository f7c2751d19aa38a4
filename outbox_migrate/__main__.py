"""`python -m outbox_migrate` runs the same CLI as the `outbox-migrate` console script."""

from outbox_migrate.cli.app import main

main()
