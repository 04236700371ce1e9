"""Tests of the machinery: broker, catalog, Spark, registry, settings, security."""
