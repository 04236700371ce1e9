"""Domain exceptions. Each message says what went wrong and what to run next."""

from __future__ import annotations

from typing import ClassVar, Literal

ErrorKind = Literal["failed", "unavailable", "usage"]


class BackfillError(Exception):
    """Base class for every error this project raises on purpose.

    ``kind`` says what the caller can do about it (the CLI's exit status follows it):
    ``"failed"`` (the default): a check or a guard refused, or the work failed; the message
    says why. ``"unavailable"``: a service (Kafka, the local stack, the catalog, the webserver)
    could not be reached or used; run again once it is back. ``"usage"``: an argument or a
    setting has a value that cannot be used; the message says what is allowed.
    """

    kind: ClassVar[ErrorKind] = "failed"


class ArgumentError(BackfillError):
    """An argument has a value the project cannot use; the message names what is allowed."""

    kind = "usage"


class SettingsError(BackfillError):
    """An environment variable has a value the project cannot use."""

    kind = "usage"


class StackError(BackfillError):
    """The local stack (Java, jars, broker, catalog) is not in a usable state."""

    kind: ClassVar[ErrorKind] = "unavailable"


class JarResolutionError(StackError):
    """Maven could not resolve a JVM artifact set."""


class BrokerError(StackError):
    """The local Kafka broker could not be formatted, started, reached or stopped."""


class GeneratorError(ArgumentError):
    """The demo event generator was given arguments it cannot honour."""


class RegistryUnavailable(StackError):
    """The schema registry did not answer a look-up the caller needs: a run publishes nothing,
    a spec whose columns come from the registry does not load."""


class LocalRegistryError(StackError):
    """The local schema registry could not be built, started, reached or stopped."""


class KafkaClientError(StackError):
    """Kafka refused or did not answer a metadata or offset request, or lacks the topic."""


class KafkaAccessError(KafkaClientError):
    """Kafka refused our credentials, or the topic is missing or not authorized for our user
    (with ACLs, Kafka answers both the same way): a setting to fix, not an outage."""

    kind: ClassVar[ErrorKind] = "usage"


class ReplayError(BackfillError):
    """A replay could not read, write or publish its window."""
