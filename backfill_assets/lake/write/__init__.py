"""The write path: replay onto a run's branch, the blocking checks, derived tables, publish
and the audit trail."""
