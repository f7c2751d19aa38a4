"""Helpers for tests, benchmarks and the simulator: throwaway PostgreSQL servers.

Not used by the migration itself; kept in the package so `bench/` and downstream projects'
tests can start the same real servers our suite uses.
"""
