"""Shared test configuration; database fixtures live in tests/fixtures/postgres.py."""
