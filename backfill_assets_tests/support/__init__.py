"""Test support shared by the tests and bench/: hostile producers, the Dagster services."""
