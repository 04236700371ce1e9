"""The lakehouse path: spec -> replay -> branch -> checks -> publish -> detect, audit, rollback."""
