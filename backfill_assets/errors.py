"""Domain exceptions. Each message says what went wrong and what to run next.

Every layer raises its errors from here, so this module imports nothing of the package: where
an error carries one of the package's values (a topic's identity, a run's branch, its check
results), a small :class:`~typing.Protocol` names the attributes it reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal, Protocol

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


class PostgresError(StackError):
    """The local Postgres could not be initialised, started, reached or stopped."""


class CdcError(StackError):
    """The CDC source (Postgres, the Kafka Connect worker, a connector) could not be started,
    reached, configured or stopped."""


class SparkConnectError(SettingsError):
    """BACKFILL_SPARK_CONNECT names an endpoint that does not answer as Spark Connect."""


class ConnectError(StackError):
    """The local Spark Connect server could not be started, reached or stopped."""


class CdsError(BackfillError):
    """The archive could not be built (the project runs without it, only slower to start)."""


class SpecError(BackfillError):
    """topics.yaml has a field the project cannot use."""


class ColumnsError(SpecError):
    """A subject's latest schema cannot give the columns (the subject is missing, or has a field
    that cannot be a column)."""


class WindowNotSealed(BackfillError):
    """An hour of the requested range cannot be fixed to offsets yet; retry later."""


class WindowError(BackfillError):
    """The range cannot be mapped to offsets (missing history, a broken chain).

    ``missing`` holds, per partition, the offsets the range may include that are neither in
    Kafka nor in the archive (empty for other causes)."""

    def __init__(self, message: str, missing: Mapping[int, tuple[int, int]] | None = None):
        super().__init__(message)
        self.missing: dict[int, tuple[int, int]] = dict(missing or {})


class LogIdentity(Protocol):
    """Which log a topic name stands for, as :class:`TopicReplaced` reads it
    (:class:`backfill_assets.stack.kafka.TopicIdentity`)."""

    @property
    def topic_id(self) -> str: ...

    @property
    def cluster_id(self) -> str: ...


class TopicReplaced(BackfillError):
    """Kafka's log of the topic is not the one the ledger's windows were read from."""

    def __init__(self, topic: str, old: LogIdentity, new: LogIdentity) -> None:
        self.topic, self.old, self.new = topic, old, new
        clusters = ""
        if old.cluster_id != new.cluster_id:
            clusters = f" (old cluster id {old.cluster_id}, new cluster id {new.cluster_id})"
        super().__init__(
            f"topic {topic!r} was deleted and recreated, or is served by another cluster: "
            f"Kafka has a new log of it (new topic id {new.topic_id}) while the ledger's "
            f"windows were read from the old log (old topic id {old.topic_id}){clusters}. The "
            "new log's offsets restart, so they cannot chain on the published ones: nothing "
            "was published, and the gap sensor requests no run of the topic. Hours published "
            "from the old log stay as they are. To read the new log from now on, run "
            f"`backfill-assets adopt --topic {topic}` (with --dry-run first to see what it "
            "does and which hours it cannot re-read)."
        )


class ArchiveError(BackfillError):
    """The archive cannot provide what was asked, or could not be written."""


class PublishError(BackfillError):
    """Main could not be moved to the audited snapshot; main is unchanged."""


class MainMoved(PublishError):
    """Main moved under the run, but only through publishes of disjoint hours: rebase."""


class NeighbourMoved(PublishError):
    """The run's offset windows no longer chain on the windows published beside them."""


class RunBranch(Protocol):
    """The branch a run wrote and audited, as :class:`NotPublished` carries it
    (:class:`backfill_assets.lake.write.wap.Branch`)."""

    @property
    def name(self) -> str: ...

    @property
    def ident(self) -> str: ...


class CheckResult(Protocol):
    """One blocking check's outcome, as :class:`NotPublished` carries it
    (:class:`backfill_assets.lake.write.checks.CheckOutcome`)."""

    @property
    def name(self) -> str: ...

    @property
    def passed(self) -> bool: ...

    @property
    def summary(self) -> str: ...

    @property
    def metadata(self) -> Mapping[str, Any]: ...


class NotPublished(BackfillError):
    """Nothing was published; the audit table says why. Carries the branch and its checks."""

    def __init__(self, message: str, branch: RunBranch, results: Sequence[CheckResult]) -> None:
        super().__init__(message)
        self.branch = branch
        self.results = results


class ChecksFailed(NotPublished):
    """A blocking check failed on the branch: main is unchanged."""

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]


class PublishRefused(NotPublished):
    """The checks passed but the publish was refused (an overlapping publish, attempts used
    up, a branch that could not be committed)."""

    def __init__(
        self, error: BaseException, branch: RunBranch, results: Sequence[CheckResult]
    ) -> None:
        super().__init__(str(error), branch, results)
        self.error = error


class MaintenanceError(BackfillError):
    """A maintenance pass could not run, or some of its steps failed (named in the message)."""


class RollbackError(BackfillError):
    """A rollback was refused or could not be applied; the table is unchanged."""


class AlreadyRolledBack(RollbackError):
    """The publishes to undo on a table are not live any more."""


class LaunchError(BackfillError):
    """The webserver refused the launch or a query; nothing was launched."""


class WebserverUnavailable(LaunchError):
    """The webserver could not be reached or did not answer in time."""

    kind = "unavailable"
