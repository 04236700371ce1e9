"""Replay an exact Kafka-time window into a raw Iceberg table, write-audit-publish.

Steps, and what is atomic:

1. **Contract**: the window ``[start, end)`` becomes, per hour and partition, a fixed offset
   range (:mod:`backfill_assets.lake.offsets.windows`: chained on the ledger's published windows,
   sealed only when Kafka can no longer add to it). The same librdkafka pass counts and hashes
   what Kafka holds there, for the checks. No consumer group is joined or committed.
2. **Read**: Spark's Kafka batch source reads exactly those offsets, committed records only,
   in executors; every record is tagged with the hour whose range holds it (``kafka_hour``),
   whatever its own timestamp, and with a hash of its Kafka bytes (``record_hash``).
3. **Parse**: payloads are read by one strict JSON pass in the JVM and upcast per schema
   version; a record that fails (invalid JSON, unknown version, a contract column NULL or out
   of range) is quarantined with its offsets, raw bytes and reason. Nothing else is dropped:
   the raw table is the committed log, one row per record (re-sends and corrections included;
   derived tables apply the duplicates rule). Tombstones stay as rows with ``is_tombstone``.
4. **Write**: quarantine rows overwrite the window's hours in the quarantine table (one atomic
   commit, kept even if the run fails, as evidence). Table rows overwrite the window's hours on
   a branch unique to the run (one atomic commit on the branch; main is not touched).
5. **Audit**: the checks read the branch (see :mod:`backfill_assets.lake.write.checks`).
6. **Publish**: :func:`backfill_assets.lake.write.wap.publish` (one catalog commit, or nothing).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from backfill_assets.errors import BackfillError
from backfill_assets.lake.decode import avro, json_schema, protobuf
from backfill_assets.lake.decode.content import RecordDecoder
from backfill_assets.lake.offsets import identity, ledger
from backfill_assets.lake.offsets.archive import Archive
from backfill_assets.lake.offsets.scan import scan
from backfill_assets.lake.offsets.windows import Decode, Windows
from backfill_assets.lake.write.wap import SUMMARY_PREFIX, Branch, open_branch, ref_sql
from backfill_assets.spec.model import SPARK_TYPES, ColumnSpec, TopicSpec
from backfill_assets.stack import faults

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import Column, DataFrame, SparkSession

    from backfill_assets.spec.transforms import StrictReader
    from backfill_assets.stack.catalog import CatalogClient
    from backfill_assets.stack.kafka import KafkaClient, TopicIdentity
    from backfill_assets.stack.settings import Settings

KAFKA_COLUMNS = (
    ("topic", "string"),
    ("kafka_partition", "int"),
    ("kafka_offset", "bigint"),
    ("kafka_timestamp", "timestamp"),
    # The Kafka-time hour whose offset range the record was read for (the table's partition).
    ("kafka_hour", "timestamp"),
    # A hash of the record's partition, offset, key and value bytes as Kafka held them.
    ("record_hash", "bigint"),
    ("kafka_key", "binary"),
    ("is_tombstone", "boolean"),
    ("schema_version", "int"),
)


# Closes the array a record is parsed in (see :func:`parse`); no real payload ends with it.
_END = "backfill-assets:end-of-record"
# Every timestamp column must fall in [start, end) UTC: a year 1234 or 33658 is a bad value,
# and pandas (the contract check) cannot hold timestamps beyond 1677..2262.
TIMESTAMP_RANGE = ("1900-01-01 00:00:00", "2200-01-01 00:00:00")
# How parse disposes of each kind of input, in the order the rules are tried (first match wins).
QUARANTINE_RULES = (
    ("record_too_large:<bytes>", "key + value longer than the topic's max_record_bytes"),
    ("missing_or_invalid:<key field>", "tombstone without a key, or with a non-UTF-8 key"),
    ("(table row)", "any other tombstone (NULL value): is_tombstone, payload columns NULL"),
    ("empty_value", "a zero-length value (not a tombstone: Kafka deletes only on NULL)"),
    ("not_avro_wire_format", "avro: shorter than 5 bytes or not starting with magic byte 0"),
    (
        "not_protobuf_wire_format",
        "protobuf: shorter than 5 bytes or not starting with magic byte 0",
    ),
    (
        "not_json_schema_wire_format",
        "json_schema: shorter than 5 bytes or not starting with magic byte 0",
    ),
    (
        "unknown_schema_id:<id>",
        "avro, protobuf, json_schema: the schema registry has no schema with that id",
    ),
    (
        "incompatible_schema:<id>",
        "avro: the writer schema does not resolve to the columns; protobuf: a field cannot be "
        "read as its column, the schema imports files or lacks the message, or the record names "
        "another message; json_schema: the id's schema is not a JSON Schema",
    ),
    ("invalid_utf8", "a value (json_schema: the payload after its header) that is not UTF-8"),
    (
        "invalid_json",
        "not exactly one JSON value: cut, trailing data, duplicate names, NaN, "
        "nesting deeper than the parser's limit (1000)",
    ),
    ("not_json_object", "a JSON array, string, number, boolean or null"),
    ("invalid_avro:<id>", "avro: the bytes do not decode with their writer schema"),
    ("invalid_protobuf:<id>", "protobuf: the bytes do not parse as the writer schema's message"),
    ("unknown_schema_version:<n|?>", "version not an upcaster's; ? if absent or not an integer"),
    ("missing_or_invalid:<column>", "a non-nullable column absent, null or of the wrong JSON kind"),
    ("not_allowed:<column>", "a value outside the column's allowed list"),
    ("below_min:<column> / above_max:<column>", "a number outside the column's min / max"),
    ("out_of_range:<column>", "a timestamp outside TIMESTAMP_RANGE"),
)


class ReplayError(BackfillError):
    """A replay could not read, write or publish its window."""


def cache(df: DataFrame) -> DataFrame:
    """Persist ``df`` on local disk only. A replay's caches grow with its window; kept in memory
    they grew the local driver JVM with it (bench/throughput.py: peak RSS 1.6x for a 10x window,
    1.15x on disk, throughput unchanged)."""
    from pyspark import StorageLevel

    return df.persist(StorageLevel.DISK_ONLY)


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
    # records it counted then and the run that published them: a re-run must not publish
    # fewer (checks: records_kept).
    published_records: dict[datetime, tuple[int, str]] = field(default_factory=dict)

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


@dataclass
class ReplayOutcome:
    """What one replay wrote, with the figures the checks and the UI need.

    The figures from ``rows_written`` on describe the run's branch and quarantine rows as
    written: :func:`backfill_assets.lake.write.checks.run_checks` measures them when it audits the
    branch (one aggregation for checks and figures) and sets them here."""

    contract: OffsetContract
    branch: Branch
    run_id: str
    records_read: int  # committed records in the windows, counted by librdkafka
    quarantine_table: str
    bytes_read: int
    bytes_written: int
    files_written: int
    duration_s: float
    rows_written: int = 0
    quarantined: int = 0
    checksum: str = "0"  # order-independent checksum of the rows' parsed content
    # Per Kafka hour (ISO, UTC): read (librdkafka), written and quarantined.
    per_hour: dict[str, dict[str, int]] = field(default_factory=dict)
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    # Event ids seen more than once in the window: identical re-sends, and ids whose copies
    # differ (corrections). Both stay rows; derived tables apply the duplicates rule.
    resent: int = 0
    conflicting_ids: int = 0
    # Per Kafka hour (ISO, UTC): the event-time hours (ISO, UTC) of its table rows with their
    # counts (tombstones excluded). The ledger keeps it so the late-data sensor never reads rows.
    event_hours: dict[str, dict[str, int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # An operator accepted that re-run hours publish fewer records than the ledger counted
    # (Kafka's compaction or truncation removed them): checks.records_kept passes, naming the
    # loss. Never set by the sensors.
    accept_fewer_records: bool = False


def audit_summary(contract: OffsetContract, run_id: str) -> dict[str, str]:
    """What every snapshot a replay commits records about itself (without the prefix)."""
    out = {
        "run-id": run_id,
        "topic": contract.topic,
        "window": f"{contract.start.isoformat()}/{contract.end.isoformat()}",
        "offsets": contract.to_json(),
    }
    if contract.windows is not None:
        out["windows"] = contract.windows.bounds_json()
    if contract.identity is not None:
        out["topic-id"] = contract.identity.topic_id
        out["cluster-id"] = contract.identity.cluster_id
    if contract.archive_ranges:
        out["archive-offsets"] = json.dumps(
            {str(p): [s, e] for p, (s, e) in sorted(contract.archive_ranges.items())},
            separators=(",", ":"),
        )
    return out


def branch_write_stats(spark: SparkSession, branch: Branch) -> dict[str, int]:
    """Numeric figures of the snapshot at the head of ``branch`` (files and bytes added...)."""
    row = spark.sql(
        f"SELECT s.summary FROM {branch.table}.snapshots s JOIN {branch.table}.refs r "
        f"ON s.snapshot_id = r.snapshot_id WHERE r.name = '{branch.name}'"
    ).first()
    summary = dict(row[0]) if row is not None else {}
    return {k: int(v) for k, v in summary.items() if v.isdigit()}


def table_ddl(spec: TopicSpec, spark_name: str) -> str:
    cols = [f"{name} {ctype}" for name, ctype in KAFKA_COLUMNS]
    cols += [f"{c.name} {SPARK_TYPES[c.type]}" for c in spec.columns]
    cols.append("ingest_run_id string")
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} ({', '.join(cols)}) USING iceberg "
        "PARTITIONED BY (hours(kafka_hour)) "
        "TBLPROPERTIES ('format-version'='2', 'write.wap.enabled'='true')"
    )


def quarantine_ddl(spark_name: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {spark_name} (topic string, kafka_partition int, "
        "kafka_offset bigint, kafka_timestamp timestamp, kafka_hour timestamp, "
        "record_hash bigint, kafka_key binary, kafka_value binary, "
        "reason string, ingest_run_id string) USING iceberg "
        "PARTITIONED BY (hours(kafka_hour)) TBLPROPERTIES ('format-version'='2')"
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
) -> OffsetContract:
    """The exact offsets of hours ``[start, end)`` (see
    :func:`backfill_assets.lake.offsets.scan.scan`),
    chained on ``published`` (the ledger's windows of the topic's raw table); with ``decode``,
    the records are also decoded independently (:mod:`backfill_assets.lake.decode.content`): all of
    them up to ``decode_whole_up_to`` records, else 1 in ``decode_sample``.

    Offsets below a partition's log start offset come from the archive. Raises
    :class:`~backfill_assets.lake.offsets.windows.WindowNotSealed` or
    :class:`~backfill_assets.lake.offsets.windows.WindowError` rather than guess.
    """
    windows = scan(
        kafka,
        topic,
        start,
        end,
        published=published,
        archive=archive,
        seal_grace=seal_grace,
        decode=decode,
        decode_sample=decode_sample,
        decode_whole_up_to=decode_whole_up_to,
    )
    return OffsetContract(topic, start, end, windows.ranges, windows.kafka_start, windows)


def read_contract(spark: SparkSession, settings: Settings, contract: OffsetContract) -> DataFrame:
    """Exactly the contract's offsets, with Spark's Kafka source schema: offsets below Kafka's
    log start from the archive's Parquet files, the rest from Kafka (read in executors)."""
    from pyspark.sql import functions as F

    archived = contract.archive_ranges
    frames = []
    if not archived or any(e > s for s, e in contract.kafka_ranges.values()):
        frames.append(_read_kafka(spark, settings, contract.topic, contract.kafka_ranges))
    if archived:
        store = Archive(settings)
        paths: list[str] = []
        cond: Column | None = None
        for p, (s, e) in sorted(archived.items()):
            paths += [store.spark_uri(f.path) for f in store.files_for(contract.topic, p, s, e)]
            part = (F.col("partition") == p) & (F.col("offset") >= s) & (F.col("offset") < e)
            cond = part if cond is None else cond | part
        assert cond is not None
        frames.append(
            spark.read.parquet(*paths)
            .where(cond)
            .select("key", "value", "topic", "partition", "offset", "timestamp", "timestampType")
        )
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionByName(frame)
    return union


def _read_kafka(
    spark: SparkSession, settings: Settings, topic: str, ranges: dict[int, tuple[int, int]]
) -> DataFrame:
    parts = sorted(ranges)
    reader = spark.read.format("kafka")
    for key, value in settings.kafka.spark_options().items():
        reader = reader.option(key, value)
    return (
        reader.option("assign", json.dumps({topic: parts}))
        .option("startingOffsets", json.dumps({topic: {str(p): ranges[p][0] for p in parts}}))
        .option("endingOffsets", json.dumps({topic: {str(p): ranges[p][1] for p in parts}}))
        .option("failOnDataLoss", "true")
        .option("includeHeaders", "false")
        .load()
    )


def chunk_contract(contract: OffsetContract, max_records: int) -> list[OffsetContract]:
    """Split a contract into consecutive pieces of at most ``max_records`` offsets, each
    advancing every partition in proportion to what it has left. A piece is a plain offset
    range: the contract's per-hour windows (and their record counts) describe the whole, so
    pieces do not carry them."""
    if max_records <= 0:
        raise ReplayError("max_records must be positive")
    pos = {p: s for p, (s, _) in contract.ranges.items()}
    end = {p: e for p, (_, e) in contract.ranges.items()}
    pieces = []
    while any(pos[p] < end[p] for p in pos):
        left = {p: end[p] - pos[p] for p in pos}
        total = sum(left.values())
        budget = min(max_records, total)
        take = {p: (left[p] * budget) // total for p in pos}
        # Hand out what integer division left over, one offset at a time.
        spare = budget - sum(take.values())
        for p in sorted(pos, key=lambda q: left[q] - take[q], reverse=True):
            if spare == 0:
                break
            if take[p] < left[p]:
                take[p] += 1
                spare -= 1
        pieces.append(
            replace(
                contract,
                ranges={p: (pos[p], pos[p] + take[p]) for p in sorted(pos)},
                windows=None,
            )
        )
        pos = {p: pos[p] + take[p] for p in pos}
    return pieces


def read_throttled(
    spark: SparkSession,
    settings: Settings,
    contract: OffsetContract,
    max_records_per_s: int,
    chunk_seconds: float = 5.0,
) -> tuple[DataFrame, list[DataFrame]]:
    """Read the contract chunk by chunk so the read rate stays at or under the cap.

    Each chunk (``cap * chunk_seconds`` offsets) is read and cached, then the reader sleeps
    until the elapsed time matches the records read so far at the cap. Returns the union of
    the chunks and the cached pieces (to unpersist when done).
    """
    pieces = chunk_contract(contract, max(1, int(max_records_per_s * chunk_seconds)))
    began = time.monotonic()
    done = 0
    cached: list[DataFrame] = []
    for piece in pieces:
        frame = cache(read_contract(spark, settings, piece))
        frame.count()
        cached.append(frame)
        done += piece.offsets
        pause = done / max_records_per_s - (time.monotonic() - began)
        if pause > 0:
            time.sleep(pause)
    if not cached:
        return read_contract(spark, settings, contract), []
    union = cached[0]
    for frame in cached[1:]:
        union = union.unionByName(frame)
    return union, cached


def parse(
    spec: TopicSpec, raw: DataFrame, run_id: str, writers: Mapping[int, Any] | None = None
) -> tuple[DataFrame, DataFrame, DataFrame]:
    """Split Kafka records into (table rows, quarantine rows), upcast to the latest schema;
    the third frame is the cached parse both are read from (the caller unpersists it last).

    ``raw`` is the Kafka source's frame after :func:`attribute`. Nothing is deduplicated. The
    rule for every kind of bad input, first match wins, is in :data:`QUARANTINE_RULES`; a
    tombstone (NULL value) is a row. An avro topic's values are decoded by
    :func:`backfill_assets.lake.decode.avro.decode_stage` with ``writers`` (every schema id of the
    window, :func:`backfill_assets.lake.decode.avro.resolve`), a protobuf topic's by
    :func:`backfill_assets.lake.decode.protobuf.decode_stage`. A json_schema topic's header is
    checked
    against ``writers`` (:func:`backfill_assets.lake.decode.json_schema.resolve`), then the payload
    after it is read by the json rules.

    The JSON is read once per record by the strict JVM reader
    (:class:`~backfill_assets.spec.transforms.StrictReader`), which returns every field the
    upcasters ask for; the projection is built in stages, each a column the next one reads (the
    typed columns read the reader's struct, the reason reads the typed columns): Spark keeps a
    stage whose columns are read more than once instead of inlining it, and the disk cache at
    the end keeps the filters on ``_reason`` from being pushed below the stages with every
    expression inlined (``test_raw_asset`` asserts the JSON is parsed once).
    """
    from pyspark.sql import functions as F

    col_names = [c.name for c in spec.columns]
    if spec.format in ("avro", "protobuf"):
        kind = avro if spec.format == "avro" else protobuf
        df, kafka_cols = kind.decode_stage(spec, raw, writers or {})
        key_str = F.col("kafka_key").cast("string")
        # A tombstone's key field is its key, if that is UTF-8 text (as for JSON topics).
        key_text = F.when(F.col("is_tombstone") & F.is_valid_utf8(key_str), key_str)
        df = df.select(
            *kafka_cols,
            "schema_version",
            "_wire",
            *[
                F.coalesce(F.col(name), key_text).alias(name) if name == spec.key_field else name
                for name in col_names
            ],
        )
        reason = _reason(spec, _avro_rules())
    elif spec.format == "json_schema":
        # The header's id, carried through the JSON stages; the JSON is what follows it.
        payload = F.expr(f"substring(value, {json_schema.HEADER + 1})")
        df, kafka_cols = _json_stage(spec, raw.select("*", avro.id_column().alias("_sid")), payload)
        body = F.expr(f"substring(kafka_value, {json_schema.HEADER + 1})")
        rules = json_schema.wire_rules(writers or {})
        reason = _reason(spec, rules + _json_rules(spec, F.col("schema_version"), body))
    else:
        df, kafka_cols = _json_stage(spec, raw)
        reason = _reason(spec, _json_rules(spec, F.col("schema_version")))
    df = df.select(*kafka_cols, "schema_version", *col_names, reason.alias("_reason")).select(
        *[
            # Only quarantine rows keep the value bytes (the table does not store them): the
            # cache holds what the two writes need, no more.
            F.when(F.col("_reason").isNotNull(), F.col(c)).alias(c) if c == "kafka_value" else c
            for c in kafka_cols
        ],
        "schema_version",
        *col_names,
        "_reason",
        F.lit(run_id).alias("ingest_run_id"),
    )
    parsed = cache(df)
    return _rows(parsed, col_names), _quarantine(parsed), parsed


def _json_stage(
    spec: TopicSpec, raw: DataFrame, payload: Column | None = None
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, ``_invalid_json``, ``schema_version``, ``_object`` and the spec's
    columns read from the JSON payload (``payload``, default the Kafka value); and the names of
    the Kafka columns (with ``_sid`` if ``raw`` has it)."""
    from pyspark.sql import functions as F

    from backfill_assets.spec.transforms import StrictReader, json_field, reading

    v = F.col("_v")
    # The upcasters' fields are read by one strict JVM pass over the text (StrictReader); it
    # also says whether the text is exactly one JSON value and whether that is an object.
    reader = StrictReader(v, "_j")
    with reading(reader):
        if spec.version_field is None:  # no version field: every record is the latest version
            version_expr = F.lit(spec.latest_version).cast("int")
        else:
            version_expr = json_field(v, f"$.{spec.version_field}", "int")
        upcast = {ver: spec.upcaster(ver)(v) for ver in spec.versions}
        present = reader.field(f"$.{spec.key_field}", "present")
    df, kafka_cols = _payload_stage(raw, reader, payload)
    df = df.select(
        *kafka_cols,
        "_j",
        "_v",
        version_expr.alias("schema_version"),
        F.coalesce(reader.is_object(), F.lit(False)).alias("_object"),
    )
    version = F.col("schema_version")
    typed = _typed_columns(spec, upcast, version)
    col_names = [c.name for c in spec.columns]
    df = df.select(*kafka_cols, "_j", "_v", "schema_version", "_object", *typed)
    # The key stands in for a key field the payload lacks (tombstones), if it is UTF-8 text.
    key_str = F.col("kafka_key").cast("string")
    if present is None:
        absent = F.try_variant_get(v, f"$.{spec.key_field}", "variant").isNull()
    else:
        absent = ~F.coalesce(present, F.lit(False))
    key_text = F.when(absent & F.is_valid_utf8(key_str), key_str)
    df = df.select(
        *kafka_cols,
        (~F.coalesce(reader.whole(), F.lit(False))).alias("_invalid_json"),
        "schema_version",
        "_object",
        *[
            F.coalesce(F.col(name), key_text).alias(name) if name == spec.key_field else name
            for name in col_names
        ],
    )
    return df, kafka_cols


def _payload_stage(
    raw: DataFrame, reader: StrictReader, payload: Column | None = None
) -> tuple[DataFrame, list[str]]:
    """The Kafka columns, the strict reader's struct ``_j`` and the payload as VARIANT ``_v``
    (NULL unless the text is exactly one JSON value); and the names of the Kafka columns."""
    from pyspark.sql import functions as F

    value_str = (F.col("value") if payload is None else payload).cast("string")
    carried = [F.col("_sid")] if "_sid" in raw.columns else []
    # A field the JVM reader cannot read (an upcaster's own VARIANT expression) reads ``_v``,
    # the payload as VARIANT; unused, Spark prunes it and the text is parsed once.
    # Spark's JSON parser stops after the first value, so '{...} junk' or '{...}{...}' would
    # parse as the first object and silently lose the rest. Parsed as the first element of an
    # array closed by a sentinel, only a record holding exactly one JSON value parses whole.
    df = raw.select(
        F.col("topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("kafka_hour"),
        F.col("record_hash"),
        F.col("key").alias("kafka_key"),
        F.col("value").alias("kafka_value"),
        F.col("value").isNull().alias("is_tombstone"),
        *carried,
        reader.call(raw.sparkSession, value_str).alias("_j"),
        F.try_parse_json(F.concat(F.lit("["), value_str, F.lit(f',"{_END}"]'))).alias("_w"),
    )
    kafka_cols = [c for c in df.columns if c not in ("_j", "_w")]
    w = F.col("_w")
    whole = (F.try_variant_get(w, "$[1]", "string") == F.lit(_END)) & F.try_variant_get(
        w, "$[2]", "variant"
    ).isNull()
    df = df.select(
        *kafka_cols, "_j", F.when(whole, F.try_variant_get(w, "$[0]", "variant")).alias("_v")
    )
    return df, kafka_cols


def _typed_columns(
    spec: TopicSpec, upcast: dict[int, dict[str, Column]], version: Column
) -> list[Column]:
    """Each spec column as its type, read by the upcaster of the record's schema version."""
    from pyspark.sql import functions as F

    versions = spec.versions
    typed: list[Column] = []
    for col in spec.columns:
        branches = [upcast[ver].get(col.name, F.lit(None)) for ver in versions]
        if len({str(b) for b in branches}) == 1:
            # Every version reads the column the same way: no per-version dispatch (a record
            # of an unknown version is quarantined before its columns matter).
            expr = branches[0]
        else:
            case: Column | None = None
            for ver, branch in zip(versions, branches, strict=True):
                case = (
                    F.when(version == ver, branch)
                    if case is None
                    else case.when(version == ver, branch)
                )
            assert case is not None
            expr = case
        typed.append(expr.cast(SPARK_TYPES[col.type]).alias(col.name))
    return typed


def _reason(spec: TopicSpec, payload_rules: list[tuple[Column, Column]]) -> Column:
    """The quarantine reason of a record (NULL for a row): :data:`QUARANTINE_RULES`, first
    match wins (``payload_rules``: the format's own, as (condition, reason)), then each
    column's contract."""
    from pyspark.sql import functions as F

    size = F.coalesce(F.length("kafka_key"), F.lit(0)) + F.coalesce(
        F.length("kafka_value"), F.lit(0)
    )
    reason: Column = F.when(
        size > spec.max_record_bytes, F.concat(F.lit("record_too_large:"), size.cast("string"))
    )
    reason = reason.when(
        F.col("is_tombstone") & F.col(spec.key_field).isNull(),
        F.lit(f"missing_or_invalid:{spec.key_field}"),
    )
    reason = reason.when(F.col("is_tombstone"), F.lit(None).cast("string"))
    reason = reason.when(F.length("kafka_value") == 0, F.lit("empty_value"))
    for condition, why in payload_rules:
        reason = reason.when(condition, why)
    for col in spec.columns:
        reason = _column_rules(reason, col)
    return reason


def _json_rules(
    spec: TopicSpec, version: Column, value: Column | None = None
) -> list[tuple[Column, Column]]:
    """The json payload's reasons; ``value``: the payload's bytes (default the Kafka value)."""
    from pyspark.sql import functions as F

    value = F.col("kafka_value") if value is None else value
    return [
        (~F.is_valid_utf8(value.cast("string")), F.lit("invalid_utf8")),
        (F.col("_invalid_json"), F.lit("invalid_json")),
        (~F.col("_object"), F.lit("not_json_object")),
        (
            version.isNull() | ~version.isin(spec.versions),
            F.concat(
                F.lit("unknown_schema_version:"), F.coalesce(version.cast("string"), F.lit("?"))
            ),
        ),
    ]


def _avro_rules() -> list[tuple[Column, Column]]:
    """An avro value's wire-format reason
    (:func:`backfill_assets.lake.decode.avro.decode_stage`)."""
    from pyspark.sql import functions as F

    return [(F.col("_wire").isNotNull(), F.col("_wire"))]


def _column_rules(reason: Column, col: ColumnSpec) -> Column:
    from pyspark.sql import functions as F

    c = F.col(col.name)
    if not col.nullable:
        reason = reason.when(c.isNull(), F.lit(f"missing_or_invalid:{col.name}"))
    if col.allowed is not None:
        reason = reason.when(~c.isin(list(col.allowed)), F.lit(f"not_allowed:{col.name}"))
    if col.min is not None:
        reason = reason.when(c < F.lit(col.min), F.lit(f"below_min:{col.name}"))
    if col.max is not None:
        reason = reason.when(c > F.lit(col.max), F.lit(f"above_max:{col.name}"))
    if col.type == "timestamp":
        lo, hi = (F.to_timestamp(F.lit(t)) for t in TIMESTAMP_RANGE)
        reason = reason.when((c < lo) | (c >= hi), F.lit(f"out_of_range:{col.name}"))
    return reason


def _quarantine(parsed: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    return parsed.where(F.col("_reason").isNotNull()).select(
        "topic",
        "kafka_partition",
        "kafka_offset",
        "kafka_timestamp",
        "kafka_hour",
        "record_hash",
        "kafka_key",
        "kafka_value",
        F.col("_reason").alias("reason"),
        "ingest_run_id",
    )


def _rows(parsed: DataFrame, col_names: list[str]) -> DataFrame:
    """The table's rows; tombstones carry only the key (their payload columns stay NULL)."""
    from pyspark.sql import functions as F

    table_cols = [name for name, _ in KAFKA_COLUMNS] + col_names
    return parsed.where(F.col("_reason").isNull()).select(*table_cols, "ingest_run_id")


def checksum_expr(spec: TopicSpec) -> Column:
    """Order-independent checksum: the sum of a 64-bit hash of every row's key columns."""
    from pyspark.sql import functions as F

    cols = ["kafka_partition", "kafka_offset", "is_tombstone", *[c.name for c in spec.columns]]
    return F.coalesce(
        F.sum(F.xxhash64(*[F.col(c) for c in cols]).cast("decimal(38,0)")), F.lit(0)
    ).cast("string")


def window_filter(contract: OffsetContract, column: str = "kafka_hour") -> Column:
    """Rows of the contract's hours. Bounds go to Spark zone-aware (UTC): a naive datetime would
    be read in the machine's local zone."""
    from pyspark.sql import functions as F

    start, end = contract.start.astimezone(UTC), contract.end.astimezone(UTC)
    return (F.col(column) >= F.lit(start)) & (F.col(column) < F.lit(end))


def record_hash_expr() -> Column:
    """:func:`backfill_assets.lake.offsets.windows.record_hash` in Spark, over the Kafka columns."""
    from pyspark.sql import functions as F

    key, value = F.col("key"), F.col("value")
    return F.xxhash64(F.col("partition"), F.col("offset"), key, value, key.isNull(), value.isNull())


def attribute(spark: SparkSession, source: DataFrame, contract: OffsetContract) -> DataFrame:
    """Tag every record with the hour whose offset range holds it (``kafka_hour``) and with
    its ``record_hash``. A record outside every range gets a NULL hour (the checks count it)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    from backfill_assets.lake.offsets.windows import as_spark_rows

    if contract.windows is None:
        raise ReplayError("attribute() needs a contract made by offset_contract()")
    schema = StructType(
        [StructField(n, LongType(), False) for n in ("w_partition", "w_start", "w_end", "w_ms")]
    )
    cells = spark.createDataFrame(list(as_spark_rows(contract.windows)), schema)
    joined = source.join(
        F.broadcast(cells),
        (F.col("partition") == F.col("w_partition"))
        & (F.col("offset") >= F.col("w_start"))
        & (F.col("offset") < F.col("w_end")),
        "left",
    )
    return joined.select(
        *source.columns,
        F.timestamp_millis(F.col("w_ms")).alias("kafka_hour"),
        record_hash_expr().alias("record_hash"),
    )


def ensure_tables(
    spark: SparkSession,
    settings: Settings,
    spec: TopicSpec,
    table: str,
    qtable: str,
    catalog: Catalog | None = None,
) -> None:
    """Create the raw and quarantine tables; refuse tables in the old layout, which partitioned
    rows by their own timestamps (not by the window that read them).

    With ``catalog`` (the same catalog, through pyiceberg), tables that exist in the current
    layout are seen from their metadata alone: no Spark SQL statement, each of which costs a
    fresh run process a few hundred milliseconds."""
    if catalog is not None and all(_current_layout(catalog, name) for name in (table, qtable)):
        return
    spark.sql(
        f"CREATE NAMESPACE IF NOT EXISTS {settings.catalog.name}.{settings.catalog.namespace}"
    )
    spark.sql(table_ddl(spec, table))
    spark.sql(quarantine_ddl(qtable))
    for name in (table, qtable):
        if "kafka_hour" not in spark.table(name).columns:
            raise ReplayError(
                f"table {name} has the old layout (rows partitioned by their own Kafka "
                "timestamp, not by the offset window that read them), which can misplace "
                f"records. Drop it (Spark SQL: DROP TABLE {name} PURGE) and backfill again; "
                "the local demo stack can simply be reset by deleting .stack/"
            )


def window_contract(
    *,
    settings: Settings,
    kafka: KafkaClient,
    iceberg: CatalogClient,
    spec: TopicSpec,
    start: datetime,
    end: datetime,
) -> OffsetContract:
    """Step 1: the window's exact offsets, chained on the raw table's ledger. Needs no Spark,
    so a run does it while its Spark session starts. Raises
    :class:`~backfill_assets.lake.offsets.identity.TopicReplaced` before computing anything when
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
        archive=Archive(settings),
        published=published,
        seal_grace=timedelta(seconds=settings.seal_grace_s),
        decode=RecordDecoder(spec, settings.schema_registry_url),
        decode_sample=settings.content_sample,
        decode_whole_up_to=settings.content_sample_above,
    )
    return replace(
        contract,
        identity=read,
        published_records={
            h: (e.records, e.run_id)
            for h, e in covered.items()
            if start <= h < end and e.offsets is not None and e.records is not None
        },
    )


def _current_layout(catalog: Catalog, spark_name: str) -> bool:
    """Whether ``catalog.namespace.table`` exists with a ``kafka_hour`` column."""
    from pyiceberg.exceptions import NoSuchTableError

    try:
        table = catalog.load_table(spark_name.split(".", 1)[1])
    except NoSuchTableError:
        return False
    return "kafka_hour" in {f.name for f in table.schema().fields}


def replay_to_branch(
    spark: SparkSession,
    contract: OffsetContract,
    *,
    settings: Settings,
    iceberg: CatalogClient,
    spec: TopicSpec,
    run_id: str,
    began: float | None = None,
) -> ReplayOutcome:
    """Steps 2-4: read the contract's offsets, parse, write the window to a run branch (main
    untouched); the quarantine rows are one atomic overwrite of the window's hours.
    ``began`` (``time.monotonic()``) is when step 1 began, for the outcome's duration."""

    began = time.monotonic() if began is None else began
    table = iceberg.spark_name(spec.raw_table)
    qtable = iceberg.spark_name(spec.quarantine_table)
    ensure_tables(spark, settings, spec, table, qtable, iceberg.catalog())
    assert contract.windows is not None
    chunks: list[DataFrame] = []
    if settings.replay_max_records_per_s:
        source, chunks = read_throttled(
            spark, settings, contract, settings.replay_max_records_per_s
        )
    else:
        source = read_contract(spark, settings, contract)
    raw = attribute(spark, source, contract)
    # One cache: the parse (on local disk). Rows and quarantine are filters of it; the first
    # write fills it, the second reads it back. The run's figures are measured on the branch
    # as written, by the checks (checks.run_checks).
    writers: Mapping[int, Any] | None = None
    if spec.format == "avro":
        writers = avro.resolve(spec, settings.schema_registry_url, contract.windows.schema_ids)
    elif spec.format == "protobuf":
        writers = protobuf.resolve(spec, settings.schema_registry_url, contract.windows.schema_ids)
    elif spec.format == "json_schema":
        writers = json_schema.resolve(settings.schema_registry_url, contract.windows.schema_ids)
    rows, quarantine, parsed = parse(spec, raw, run_id, writers)
    try:
        props = audit_summary(contract, run_id)
        qwriter = quarantine.writeTo(qtable)
        for key, value in props.items():
            qwriter = qwriter.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
        qwriter.overwrite(window_filter(contract))

        branch = open_branch(spark, table, run_id)
        writer = rows.writeTo(branch.ident)
        for key, value in props.items():
            writer = writer.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
        writer.overwrite(window_filter(contract))
        written = branch_write_stats(spark, branch)
        faults.after_branch_write(spark, branch.ident, qtable, contract)
    finally:
        parsed.unpersist()
        for chunk in chunks:
            chunk.unpersist()
    kafka_side = contract.windows.hour_figures()
    return ReplayOutcome(
        contract=contract,
        branch=branch,
        run_id=run_id,
        records_read=contract.windows.records,
        quarantine_table=qtable,
        bytes_read=sum(k["bytes"] for k in kafka_side.values()),
        bytes_written=written.get("added-files-size", 0),
        files_written=written.get("added-data-files", 0),
        duration_s=time.monotonic() - began,
    )


def hour_key(epoch_ms: int) -> str:
    """An hour collected from Spark as epoch millis (never as a datetime, which PySpark would
    convert with the machine's local zone), as an ISO string in UTC."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat()


def reapply(spark: SparkSession, outcome: ReplayOutcome, attempt: int) -> Branch:
    """Rebase: open a new branch from main's current snapshot and copy the run's rows for its
    window there from the old branch (nothing is read from Kafka again). One commit on the new
    branch; main is not touched. The old branch is dropped."""
    old = outcome.branch
    rows = cache(spark.table(old.ident).where(window_filter(outcome.contract)))
    try:
        rows.count()
        props = audit_summary(outcome.contract, outcome.run_id)
        branch = open_branch(spark, old.table, outcome.run_id, attempt)
        writer = rows.writeTo(branch.ident)
        for key, value in props.items():
            writer = writer.option(f"snapshot-property.{SUMMARY_PREFIX}{key}", value)
        writer.overwrite(window_filter(outcome.contract))
    finally:
        rows.unpersist()
    ref_sql(spark, old.table, f"ALTER TABLE {old.table} DROP BRANCH IF EXISTS `{old.name}`")
    return branch
