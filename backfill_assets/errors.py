"""Domain exceptions. Each message says what went wrong and what to run next."""

from __future__ import annotations


class BackfillError(Exception):
    """Base class for every error this project raises on purpose."""


class SettingsError(BackfillError):
    """An environment variable has a value the project cannot use."""


class StackError(BackfillError):
    """The local stack (Java, jars, broker, catalog) is not in a usable state."""


class JarResolutionError(StackError):
    """Maven could not resolve a JVM artifact set."""


class BrokerError(StackError):
    """The local Kafka broker could not be formatted, started, reached or stopped."""


class GeneratorError(BackfillError):
    """The demo event generator was given arguments it cannot honour."""


class KafkaClientError(StackError):
    """Kafka refused or did not answer a metadata or offset request, or lacks the topic."""
