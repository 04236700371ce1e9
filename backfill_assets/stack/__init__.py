"""The stack: settings, the local Kafka broker, jars, the Iceberg catalog and Spark."""
