"""Tests of the exact replay and its guarantees, against the real broker, Spark and catalog."""
