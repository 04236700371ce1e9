"""Per-topic transforms: upcasters from each schema version to the latest schema."""
