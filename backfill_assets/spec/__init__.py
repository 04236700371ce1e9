"""The topic-to-table spec: its model, loader, declared tables and transforms (no Spark started)."""
