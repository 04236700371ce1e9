"""The plain Kafka client: topic metadata and ListOffsets look-ups with confluent-kafka.

It never subscribes, joins or commits to a consumer group, and it reads committed: every offset
it answers is below the last stable offset. A broker that refuses the credentials, does not
answer or lacks the topic raises :class:`~backfill_assets.errors.KafkaClientError`, naming the
broker, the topic and the settings to check. The Dagster resource
(:class:`backfill_assets.defs.resources.KafkaResource`) only wraps it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from backfill_assets.errors import KafkaAccessError, KafkaClientError
from backfill_assets.stack.settings import KafkaSettings, Settings

_log = logging.getLogger(__name__)
T = TypeVar("T")
# What a ListOffsets request asks for (KafkaClient.list_offsets).
OffsetQuery = Literal["earliest", "latest", "max_timestamp"]

# Errors a broker failing over gives for a while (the dead leader's requests time out; the
# others answer "not the leader" until the metadata moves): a look-up retries them.
_FAILOVER_CODES = {
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._DESTROY_BROKER,  # the dead broker's handle, decommissioned mid-request
}
FAILOVER_ATTEMPTS = 4


def through_failover(what: str, call: Callable[[], T], attempts: int = FAILOVER_ATTEMPTS) -> T:
    """``call()``, retried while Kafka answers as a cluster whose broker is failing over (a
    replica takes over a dead leader's partitions within seconds); other errors, and the last
    attempt's, are raised as they are."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if attempt == attempts or err is None or err.code() not in _FAILOVER_CODES:
                raise
            _log.warning(
                "Kafka %s failed (%s), attempt %d of %d; retrying: a broker may be failing over",
                what, err.str(), attempt, attempts,
            )  # fmt: skip
            time.sleep(2.0)
    raise AssertionError("unreachable")


def offsets_gone(err: KafkaError | None) -> bool:
    """Whether a consumer's error says its assigned offset is no longer in the log (the
    ``auto.offset.reset=error`` of :meth:`KafkaClient.range_consumer`)."""
    return err is not None and err.code() in (
        KafkaError._AUTO_OFFSET_RESET,
        KafkaError.OFFSET_OUT_OF_RANGE,
    )


@dataclass(frozen=True)
class TopicIdentity:
    """Which log a topic name stands for: the topic id Kafka gave the topic when it was created
    and the id of the cluster serving it. A topic deleted and recreated gets a new topic id (its
    offsets restart at 0); a topic served by another cluster after a failover has another
    cluster id (and topic id)."""

    topic_id: str
    cluster_id: str


class KafkaClient:
    """Kafka metadata and offset look-ups. Never joins or commits to a consumer group.

    Reads :class:`Settings` from the environment at each call unless given ``settings``, so a
    long-lived client follows the process's environment as the Dagster resource did."""

    def __init__(self, settings: Settings | None = None, request_timeout_s: float = 30.0) -> None:
        self._settings = settings
        self.request_timeout_s = request_timeout_s

    @property
    def settings(self) -> Settings:
        return self._settings or Settings.from_env()

    def admin(self) -> AdminClient:
        return AdminClient(self.settings.kafka.client_config())

    def offsets_consumer(self) -> Consumer:
        """A consumer used only for ListOffsets look-ups: it never subscribes or commits.

        librdkafka requires a group.id to construct a consumer; this one is unique per
        process and is never joined, so no consumer group state is created on the broker.
        """
        conf: dict[str, str | int | float | bool] = {
            **self.settings.kafka.client_config(),
            "group.id": "backfill-assets-offsets-lookup",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # Committed reads: ListOffsets answers only below the last stable offset, and
            # records of aborted transactions are never returned.
            "isolation.level": "read_committed",
            # It never fetches; stated so no consumer of the package relies on a default.
            "auto.offset.reset": "error",
        }
        return Consumer(conf)

    def range_consumer(self, purpose: str, *, eof: bool = True) -> Consumer:
        """A consumer that reads offset ranges it is assigned (``purpose`` names it, as a
        group id the broker never sees joined or committed).

        An assigned offset that is no longer in the log (retention or ``delete_records``
        overtook the reader) is an error message (:func:`offsets_gone` tells it), never a
        silent jump to the log's end or start: librdkafka's ``auto.offset.reset`` is
        ``error``. It reads committed records only, as Spark's Kafka source does; with ``eof``
        each partition's end is a message."""
        return Consumer(
            {
                **self.settings.kafka.range_reader_config(),
                "group.id": f"backfill-assets-{purpose}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "enable.partition.eof": eof,
                "isolation.level": "read_committed",
                "auto.offset.reset": "error",
            }
        )

    def log_ends(self, topic: str) -> dict[int, tuple[int, int, int]]:
        """Per partition, (log start offset, last stable offset, high watermark).

        The last stable offset (LSO) is below the high watermark while a transaction is open:
        a committed reader cannot see past it, so nothing at or after it can be sealed.
        Retried while a broker fails over (:func:`through_failover`).
        """
        return through_failover(f"ListOffsets of topic {topic!r}", lambda: self._log_ends(topic))

    def _log_ends(self, topic: str) -> dict[int, tuple[int, int, int]]:
        parts = self.partitions(topic)
        # The high watermark is asked first, so an LSO below it means a transaction really
        # held it back (records arriving in between can only raise the LSO).
        high = self._list_offsets(topic, parts, "latest", committed=False)
        stable = self._list_offsets(topic, parts, "latest", committed=True)
        start = self._list_offsets(topic, parts, "earliest", committed=True)
        return {p: (start[p][0], stable[p][0], high[p][0]) for p in parts}

    def list_offsets(
        self, topic: str, parts: list[int], spec: OffsetQuery, *, committed: bool = True
    ) -> dict[int, tuple[int, int]]:
        """ListOffsets for ``parts`` of ``topic``: per partition (offset, timestamp ms).

        ``spec``: ``"earliest"`` (the log start offset), ``"latest"`` (the last stable offset
        when ``committed``, else the high watermark) or ``"max_timestamp"`` (the record with
        the largest timestamp; (-1, -1) for an empty partition; ``committed=False`` counts
        transaction markers too). ``committed`` is the request's isolation level
        (committed records only, or every record and marker). Retried while a broker fails over
        (:func:`through_failover`); the only place this package asks Kafka for offsets."""
        return through_failover(
            f"ListOffsets ({spec}) of topic {topic!r}",
            lambda: self._list_offsets(topic, parts, spec, committed=committed),
        )

    def _list_offsets(
        self, topic: str, parts: list[int], spec: OffsetQuery, *, committed: bool
    ) -> dict[int, tuple[int, int]]:
        from confluent_kafka import IsolationLevel

        # Re-exported by confluent_kafka.admin without an explicit export, untyped (2.16).
        from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

        if not parts:
            return {}
        query = getattr(OffsetSpec, spec)()
        level = IsolationLevel.READ_COMMITTED if committed else IsolationLevel.READ_UNCOMMITTED
        admin = self.admin()  # kept until the futures are done: a dropped client cancels them
        futures = admin.list_offsets(
            {TopicPartition(topic, p): query for p in parts},
            isolation_level=level,
            request_timeout=self.request_timeout_s,
        )
        out = {}
        for tp, future in futures.items():
            info = future.result()  # bounded by the request's own timeout
            out[tp.partition] = (int(info.offset), int(info.timestamp))
        return out

    def newest_records(
        self, topic: str, parts: list[int], *, committed: bool = True
    ) -> dict[int, tuple[int, int]]:
        """Per partition of ``parts``, (offset, timestamp ms) of its record with the largest
        timestamp (ListOffsets MAX_TIMESTAMP; (-1, -1) for an empty partition); committed
        records only unless ``committed`` is False (then a transaction marker, stamped with the
        broker's clock, can answer). Retried while a broker fails over."""
        return self.list_offsets(topic, parts, "max_timestamp", committed=committed)

    def retention_ms(self, topic: str) -> int | None:
        """The topic's ``retention.ms`` (negative: unlimited), None if the broker does not say."""
        from confluent_kafka.admin import ConfigResource, ResourceType  # type: ignore[attr-defined]

        admin = self.admin()
        resource = ConfigResource(ResourceType.TOPIC, topic)
        configs = admin.describe_configs([resource])[resource].result(
            timeout=self.request_timeout_s
        )
        entry = configs.get("retention.ms")
        return int(entry.value) if entry is not None and entry.value is not None else None

    def partitions(self, topic: str) -> list[int]:
        """The topic's partitions. Every offset look-up starts here, so this is where a broker
        that refuses our credentials fails the run at once, naming the broker, instead of
        after the request timeout with librdkafka's generic "transport failure"."""
        return sorted(self._metadata(topic)[2].partitions)

    def _metadata(self, topic: str) -> tuple[AdminClient, Any, Any]:
        """An admin client, the cluster's metadata and the topic's (see :meth:`partitions`)."""
        errors: list[KafkaError] = []
        conf: dict[str, Any] = {**self.settings.kafka.client_config(), "error_cb": errors.append}
        bootstrap = self.settings.kafka.bootstrap_servers
        try:
            admin = AdminClient(conf)
        except KafkaException as exc:  # e.g. a keystore it cannot open: a setting to fix
            cause = exc.args[0].str() if isinstance(exc.args[0], KafkaError) else str(exc)
            raise KafkaAccessError(
                f"the Kafka client for {bootstrap} could not start: {cause}. Check {_AUTH_SETTINGS}"
            ) from None
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                meta = admin.list_topics(topic=topic, timeout=1.0)
                break
            except KafkaException as exc:
                admin.poll(0)  # serves error_cb: authentication errors arrive there
                refused = _refusal(bootstrap, errors)
                if refused is not None:
                    raise refused from None
                if time.monotonic() >= deadline:
                    raise KafkaClientError(
                        f"Kafka at {bootstrap} did not answer a metadata request for topic "
                        f"{topic!r} within {self.request_timeout_s:.0f}s: {exc}"
                    ) from None
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise _missing_topic(self.settings.kafka, topic)
        return admin, meta, info

    def topic_identity(self, topic: str) -> TopicIdentity:
        """The topic's id (DescribeTopics) and the cluster's id (metadata); raises
        :class:`~backfill_assets.errors.KafkaClientError` when the topic does not exist."""
        from confluent_kafka import TopicCollection

        # Fails naming the broker, or the missing topic; the metadata names the cluster.
        admin, meta, _info = self._metadata(topic)
        futures = admin.describe_topics(
            TopicCollection([topic]), request_timeout=self.request_timeout_s
        )
        try:
            described = futures[topic].result()
        except KafkaException as exc:
            raise KafkaClientError(
                f"Kafka at {self.settings.kafka.bootstrap_servers} did not describe topic "
                f"{topic!r}: {exc}"
            ) from None
        return TopicIdentity(topic_id=str(described.topic_id), cluster_id=str(meta.cluster_id))

    def offsets_for_times(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        """Per partition, the earliest offset whose timestamp is >= ``timestamp_ms``.

        Where no such record exists, Kafka answers -1; this returns the high watermark instead,
        so ``[offset_for(start), offset_for(end))`` is always a valid, possibly empty range.
        """
        return through_failover(
            f"ListOffsets by time of topic {topic!r}",
            lambda: self._offsets_for_times(topic, timestamp_ms),
        )

    def _offsets_for_times(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        consumer = self.offsets_consumer()
        try:
            parts = self.partitions(topic)
            query = [TopicPartition(topic, p, timestamp_ms) for p in parts]
            found = consumer.offsets_for_times(query, timeout=self.request_timeout_s)
            result: dict[int, int] = {}
            for tp in found:
                if tp.offset < 0:
                    _, high = consumer.get_watermark_offsets(
                        TopicPartition(topic, tp.partition), timeout=self.request_timeout_s
                    )
                    result[tp.partition] = int(high)
                else:
                    result[tp.partition] = int(tp.offset)
            return result
        finally:
            consumer.close()

    def offsets_for_many(
        self, topic: str, timestamps_ms: list[int], *, raw: bool = False
    ) -> dict[int, dict[int, int]]:
        """:meth:`offsets_for_times` for many timestamps over one consumer (one ListOffsets
        request per timestamp: librdkafka answers one timestamp per partition per request).
        ``raw`` keeps Kafka's -1 ("no record at or after it") instead of the high watermark."""
        return through_failover(
            f"ListOffsets by time of topic {topic!r}",
            lambda: self._offsets_for_many(topic, timestamps_ms, raw),
        )

    def _offsets_for_many(
        self, topic: str, timestamps_ms: list[int], raw: bool
    ) -> dict[int, dict[int, int]]:
        consumer = self.offsets_consumer()
        try:
            parts = self.partitions(topic)
            highs = {
                p: -1
                if raw
                else int(
                    consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=self.request_timeout_s
                    )[1]
                )
                for p in parts
            }
            out: dict[int, dict[int, int]] = {}
            for ts in timestamps_ms:
                found = consumer.offsets_for_times(
                    [TopicPartition(topic, p, ts) for p in parts], timeout=self.request_timeout_s
                )
                out[ts] = {
                    tp.partition: int(tp.offset) if tp.offset >= 0 else highs[tp.partition]
                    for tp in found
                }
            return out
        finally:
            consumer.close()

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        """Per partition, (log start offset, high watermark)."""
        consumer = self.offsets_consumer()
        try:
            return {
                p: tuple(  # type: ignore[misc]
                    int(o)
                    for o in consumer.get_watermark_offsets(
                        TopicPartition(topic, p), timeout=self.request_timeout_s
                    )
                )
                for p in self.partitions(topic)
            }
        finally:
            consumer.close()


# What a client's credentials may come from, named in the errors of a refused connection.
_AUTH_SETTINGS = (
    "BACKFILL_KAFKA_PROPERTIES (sasl.jaas.config, ssl.keystore.*), or "
    "BACKFILL_KAFKA_SASL_USERNAME, BACKFILL_KAFKA_SASL_PASSWORD and BACKFILL_KAFKA_SASL_MECHANISM"
)


def _refusal(bootstrap: str, errors: list[KafkaError]) -> KafkaAccessError | None:
    """The error for a broker that refused our credentials (SASL) or our TLS handshake (a
    client certificate missing or not trusted, a CA that does not trust the broker); None
    when no such error arrived. librdkafka's messages hold no credential."""
    auth = [e for e in errors if e.code() == KafkaError._AUTHENTICATION]
    if auth:
        return KafkaAccessError(
            f"Kafka at {bootstrap} rejected authentication: {auth[0].str()}. Check "
            + _AUTH_SETTINGS
        )
    tls = [e for e in errors if e.code() == KafkaError._SSL or "SSL" in e.str()]
    if tls:
        return KafkaAccessError(
            f"Kafka at {bootstrap} refused the TLS connection: {tls[0].str()}. Check the "
            "client certificate (BACKFILL_KAFKA_PROPERTIES: ssl.keystore.*, ssl.key.password) "
            "and the CA (ssl.truststore.* there, or BACKFILL_KAFKA_SSL_CA_LOCATION)"
        )
    return None


def _missing_topic(kafka: KafkaSettings, topic: str) -> KafkaClientError:
    """The error for a topic the metadata does not hold. With SASL, Kafka hides a topic the
    user may not describe exactly as a missing one, so the message names both causes."""
    where = kafka.bootstrap_servers
    if kafka.sasl_username is None:
        return KafkaClientError(f"Kafka topic {topic!r} does not exist at {where}")
    return KafkaAccessError(
        f"Kafka topic {topic!r} is missing or not authorized for user {kafka.sasl_username!r} "
        f"at {where}: the topic does not exist, or BACKFILL_KAFKA_SASL_USERNAME has no ACL "
        "allowing it to describe and read the topic"
    )


def client_log(settings: Settings) -> logging.Logger:
    """A logger for librdkafka's own lines (connection and idempotence retries, which it
    prints on stderr and retries by itself) that writes them to
    ``<BACKFILL_HOME>/logs/kafka-clients.log``: pass it as a client's ``logger``."""
    log = logging.getLogger("backfill_assets.kafka_clients")
    path = settings.home / "logs" / "kafka-clients.log"
    if not any(getattr(h, "baseFilename", None) == str(path) for h in log.handlers):
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log
