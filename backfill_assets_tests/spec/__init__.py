"""Tests of the spec: loading, versions, registry-derived columns, column lineage."""
