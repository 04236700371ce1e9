"""Offsets: the Kafka-time window rule, the ledger of published windows, the log's identity
and the offset-addressed archive."""
