"""Background jobs that run beside the application: HOPER's copy-back and outbox maintenance.

Each job is a library object (no printing, no exiting) that a CLI command, a test or a
benchmark drives; the job owns its own state table under the `outbox_migrate` schema so a
restart continues where the previous process stopped.
"""
