"""Helpers for tests, benchmarks and the simulator: throwaway PostgreSQL servers and brokers.
Not used by the migration itself."""
