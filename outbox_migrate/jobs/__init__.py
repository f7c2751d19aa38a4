"""Background jobs beside the application: HOPER's copy-back and outbox maintenance. Library
code that a CLI command, a test or a benchmark drives: it never prints or exits.
"""
