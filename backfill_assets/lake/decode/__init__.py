"""Decoding Kafka records: the registry wire formats (Avro, Protobuf, JSON Schema) and the
independent reference decode the content check compares with Spark's."""
