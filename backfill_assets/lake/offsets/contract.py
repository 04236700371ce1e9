"""The replay contract: exactly which offsets of which partitions a Kafka-time window covers,
fixed by the window rule on the ledger's published windows (step 1 of a replay). Reads Kafka,
the ledger and the archive; writes nothing."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from backfill_assets.lake.decode.content import RecordDecoder
from backfill_assets.lake.offsets import identity, ledger
from backfill_assets.lake.offsets.archive import Archive
from backfill_assets.lake.offsets.decode_pass import DecodePass, content_sample
from backfill_assets.lake.offsets.scan import scan
from backfill_assets.lake.offsets.windows import Decode, Windows

if TYPE_CHECKING:
    from pyspark.sql import Column

    from backfill_assets.spec.model import TopicSpec
    from backfill_assets.stack.catalog import CatalogClient
    from backfill_assets.stack.kafka import KafkaClient, TopicIdentity
    from backfill_assets.stack.settings import Settings


@dataclass(frozen=True)
class OffsetContract:
    """Exactly which offsets a window covers: partition -> [start, end)."""

    topic: str
    start: datetime
    end: datetime
    ranges: dict[int, tuple[int, int]]
    # Per partition, Kafka's log start offset when the contract was made: offsets below it
    # are read from the archive (empty: everything from Kafka).
    kafka_start: dict[int, int] = field(default_factory=dict)
    # The per-hour windows and Kafka's own figures for them (None for ad-hoc contracts).
    windows: Windows | None = None
    # The log the windows were read from (None for ad-hoc contracts).
    identity: TopicIdentity | None = None
    # The hours of the window the ledger already has a publish for, with the committed
    # records it counted then (None: its ledger row does not say) and the run that published
    # them: a re-run must not publish fewer (checks: records_kept).
    published_records: dict[datetime, tuple[int | None, str]] = field(default_factory=dict)

    @property
    def records(self) -> int:
        """Committed records (Kafka's own count) when the windows are known, else offsets
        (which include aborted records and transaction markers)."""
        if self.windows is not None:
            return self.windows.records
        return self.offsets

    @property
    def offsets(self) -> int:
        return sum(e - s for s, e in self.ranges.values())

    @property
    def archive_ranges(self) -> dict[int, tuple[int, int]]:
        """The part of each partition's range read from the archive (below log start)."""
        out = {}
        for p, (s, e) in self.ranges.items():
            low = self.kafka_start.get(p, 0)
            if s < low and e > s:
                out[p] = (s, min(e, low))
        return out

    @property
    def kafka_ranges(self) -> dict[int, tuple[int, int]]:
        """The part of each partition's range read from Kafka."""
        return {
            p: (max(s, self.kafka_start.get(p, 0)), max(e, self.kafka_start.get(p, 0)))
            for p, (s, e) in self.ranges.items()
        }

    @property
    def archived_records(self) -> int:
        return sum(e - s for s, e in self.archive_ranges.values())

    def to_json(self) -> str:
        return json.dumps(
            {str(p): [s, e] for p, (s, e) in sorted(self.ranges.items())}, separators=(",", ":")
        )


def offset_contract(
    kafka: KafkaClient,
    topic: str,
    start: datetime,
    end: datetime,
    archive: Archive | None = None,
    *,
    published: dict[datetime, dict[int, tuple[int, int]]] | None = None,
    seal_grace: timedelta = timedelta(minutes=5),
    decode: Decode | None = None,
    decode_sample: int = 1,
    decode_whole_up_to: int = 50_000,
    decode_residue: int = 0,
    decode_accepted: frozenset[tuple[int, int]] = frozenset(),
) -> OffsetContract:
    """The exact offsets of hours ``[start, end)`` (see
    :func:`backfill_assets.lake.offsets.scan.scan`),
    chained on ``published`` (the ledger's windows of the topic's raw table); with ``decode``,
    the records are also decoded independently (:mod:`backfill_assets.lake.decode.content`): all of
    the records of an hour of up to ``decode_whole_up_to`` records, else 1 in ``decode_sample``
    (those whose position hash is ``decode_residue`` modulo it).

    The decode is attached to the windows (:class:`DecodePass`): ``windows.start_decode`` runs
    it in a thread while the caller waits on Spark, ``windows.wait_decode`` waits for it
    (``hour_figures`` does; it starts the decode if nothing did).

    Offsets below a partition's log start offset come from the archive. Raises
    :class:`~backfill_assets.errors.WindowNotSealed` or
    :class:`~backfill_assets.errors.WindowError` rather than guess.
    """
    windows = scan(
        kafka, topic, start, end, published=published, archive=archive, seal_grace=seal_grace
    )
    if decode is not None:
        sample = content_sample(
            windows, decode_sample, decode_whole_up_to, decode_residue, decode_accepted
        )
        DecodePass(kafka, windows, decode, sample, archive).attach()
    return OffsetContract(topic, start, end, windows.ranges, windows.kafka_start, windows)


def window_filter(contract: OffsetContract, column: str = "kafka_hour") -> Column:
    """Rows of the contract's hours (:func:`hours_filter`)."""
    return hours_filter(contract.start, contract.end, column)


def hours_filter(start: datetime, end: datetime, column: str = "kafka_hour") -> Column:
    """Rows of hours ``[start, end)``. Bounds go to Spark zone-aware (UTC): a naive datetime
    would be read in the machine's local zone."""
    from pyspark.sql import functions as F

    start, end = start.astimezone(UTC), end.astimezone(UTC)
    return (F.col(column) >= F.lit(start)) & (F.col(column) < F.lit(end))


def window_contract(
    *,
    settings: Settings,
    kafka: KafkaClient,
    iceberg: CatalogClient,
    spec: TopicSpec,
    start: datetime,
    end: datetime,
    decode: bool = True,
) -> OffsetContract:
    """Step 1: the window's exact offsets, chained on the raw table's ledger. Needs no Spark,
    so a run does it while its Spark session starts. With ``decode`` the independent decode
    of the window's records starts in a thread (a plan needs none). Raises
    :class:`~backfill_assets.errors.TopicReplaced` before computing anything when
    Kafka's log of the topic is not the ledger's."""
    cat, raw_name = iceberg.catalog(), iceberg.spark_name(spec.raw_table)
    read = identity.check(kafka, cat, settings.catalog.namespace, spec.topic, raw_name)
    # ledger.published_offsets, from the same read: only the current log's publishes count
    every, log = ledger.log_coverage(cat, settings.catalog.namespace, raw_name)
    covered = {h: e for h, e in every.items() if log.holds(e)}
    published = {h: dict(e.offsets) for h, e in covered.items() if e.offsets is not None}
    contract = offset_contract(
        kafka,
        spec.topic,
        start,
        end,
        archive=Archive(settings, {spec.topic: read}),
        published=published,
        seal_grace=timedelta(seconds=settings.seal_grace_s),
        decode=RecordDecoder(spec, settings.schema_registry_url, settings.schema_registry_auth)
        if decode
        else None,
        decode_sample=settings.content_sample,
        decode_whole_up_to=settings.content_sample_above,
        # Drawn per run, so a re-run of a large hour compares other records than the last run.
        decode_residue=secrets.randbelow(settings.content_sample),
        decode_accepted=ledger.accepted(cat, settings.catalog.namespace, raw_name, read),
    )
    return replace(
        contract,
        identity=read,
        published_records={
            h: (e.records, e.run_id)
            for h, e in covered.items()
            if start <= h < end and e.offsets is not None
        },
    )
