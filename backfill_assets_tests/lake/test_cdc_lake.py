"""The lake reads the real Debezium's topics (issue 48): Postgres with logical decoding, Kafka
Connect and Debezium's Postgres connector (the shared ``cdc_source``), JSON with the schema
embedded and without, backfilled the way users do: the raw and current-state assets of the
hour range materialized through Dagster (support/runs.py).

Phases, each its own Kafka-time hour, each followed by the backfill of every hour so far, then
the source read by ``SELECT`` compared row for row with the current-state table, and the raw
table with the connector's committed records (offsets): the snapshot; inserts, updates (one
leaving a 100 kB TOASTed text unchanged) and deletes; a key update (Debezium: delete, tombstone,
create); a re-snapshot by a new connector and slot on the same topics whose snapshot reads
arrive after a newer change (ordered by the source's LSN, not by arrival: no stale row, no
duplicate, no deleted row back); a column added to the source, read once the spec names it.

Kafka Connect stamps records with its worker's clock, and a Kafka-time hour is backfilled only
once it has ended (and sealed), so the connectors here use the test clock
(support/cdc_source.py): each phase's records are stamped in an hour of the past, as by a worker
whose clock runs behind. Debezium's envelopes are untouched.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import TopicPartition

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.demo import cdc as demo
from backfill_assets.errors import KafkaClientError
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.cdc import CdcSource, PgSource, debezium_postgres
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.postgres import PgServer
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.cdc_source import Clock, SharedCdc
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.cdc

DATABASE, ROLE = "lake_cdc", "lakecdc"
BIG = 100_000  # characters of a large text value (stored out of line: TOAST)
# Per variant: connector name and topic prefix (also its slot), schemas.enable.
VARIANTS = {"embedded": ("lake-s", "lake_s", True), "none": ("lake-p", "lake_p", False)}
# The new connectors' snapshot waits this long after they made their slots.
RESNAPSHOT_DELAY_MS = 3000
PHASES = ("snapshot", "changes", "key update", "re-snapshot", "column added")
COLUMNS: list[dict[str, Any]] = [
    {"name": "id", "type": "bigint", "nullable": False},
    {"name": "balance", "type": "decimal(12,2)", "nullable": False},
    {"name": "updated_at", "type": "timestamp", "nullable": False},
    {"name": "attrs", "type": "string"},
    {"name": "profile", "type": "string"},
    {"name": "notes", "type": "string"},
]


def spec(variant: str, start: datetime, extra: list[dict[str, Any]] | None = None) -> TopicSpec:
    """The spec entry docs/cdc.md gives to copy, for this variant's topic."""
    _, prefix, _ = VARIANTS[variant]
    return TopicSpec.model_validate(
        {
            "topic": f"{prefix}.public.accounts",
            "format": "json",
            "envelope": "debezium",
            "schemas": variant,
            "key_field": "id",
            "partition_start": start.isoformat(),
            "allowed_lateness_hours": 0,
            "quarantine_max_ratio": 0.0,
            "columns": [*COLUMNS, *(extra or [])],
        }
    )


@dataclass
class Phase:
    """What one phase's backfill made and what the source and Kafka held then."""

    name: str
    success: bool
    checks: dict[str, bool]
    source: dict[int, dict[str, Any]]  # id -> the source's row by SELECT, as the lake holds it
    current: dict[str, dict[int, dict[str, Any]]]  # variant -> id -> the current-state row
    deleted: dict[str, set[int]]  # variant -> ids marked deleted in the current state
    raw_offsets: dict[str, list[int]]  # variant -> the raw table's offsets
    quarantined: dict[str, int]
    kafka_offsets: dict[str, list[int]]  # variant -> the committed records' offsets
    unavailable: dict[str, int]  # variant -> current rows still naming unavailable columns
    failures: list[str] = field(default_factory=list)


@dataclass
class Lake:
    settings: Settings
    spark: SparkSession
    cdc: SharedCdc
    db: PgSource
    client: KafkaClient
    clock: Clock
    start: datetime
    instance: dg.DagsterInstance
    specs: dict[str, TopicSpec]
    rng: random.Random = field(default_factory=lambda: random.Random(48))
    phases: dict[str, Phase] = field(default_factory=dict)
    columns: list[str] = field(default_factory=lambda: [c["name"] for c in COLUMNS])

    @property
    def source(self) -> CdcSource:
        return self.cdc.source

    @property
    def server(self) -> PgServer:
        return self.cdc.server

    def sql(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Each statement in its own transaction."""
        con = self.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                for text, args in statements:
                    cur.execute(text, args)
        finally:
            con.close()

    def query(self, text: str) -> list[tuple[Any, ...]]:
        con = self.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                cur.execute(text)
                return list(cur.fetchall())
        finally:
            con.close()

    def topic(self, variant: str) -> str:
        return self.specs[variant].topic


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _micros(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def source_rows(lake: Lake) -> dict[int, dict[str, Any]]:
    """The source table by ``SELECT``, as the lake holds it: json and jsonb as Postgres' text,
    timestamps as epoch microseconds."""
    cols = ", ".join(f"{c}::text" if c in ("attrs", "profile") else c for c in lake.columns)
    rows = lake.query(f"SELECT {cols} FROM accounts")
    out = {}
    for row in rows:
        values = dict(zip(lake.columns, row, strict=True))
        values["updated_at"] = _micros(values["updated_at"])
        out[values["id"]] = values
    return out


def lake_rows(lake: Lake, variant: str) -> tuple[dict[int, dict[str, Any]], set[int], int]:
    """The current-state table: live rows by id (as :func:`source_rows`), deleted ids, and rows
    still naming a column Debezium left out."""
    from pyspark.sql import functions as F

    ns = lake.settings.catalog.namespace
    table = lake.spark.table(f"lake.{ns}.{lake.specs[variant].current_table}")
    rows = table.withColumn("updated_at", F.unix_micros("updated_at")).collect()
    live = {r["id"]: {c: r[c] for c in lake.columns} for r in rows if not r["deleted"]}
    gone = {r["id"] for r in rows if r["deleted"]}
    unavailable = sum(1 for r in rows if r["cdc_unavailable"] is not None)
    return live, gone, unavailable


def kafka_offsets(lake: Lake, variant: str) -> list[int]:
    """The offsets of the committed records of the variant's topic (one partition)."""
    topic = lake.topic(variant)
    high = lake.client.log_ends(topic)[0][1]
    consumer = lake.client.range_consumer("cdc-lake-test")
    offsets: list[int] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 60
        while (not offsets or offsets[-1] < high - 1) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                offsets.append(int(msg.offset() or 0))
    finally:
        consumer.close()
    return offsets


Change = tuple[str | None, int]  # (op, or None for a tombstone; the key's id)


def changes(lake: Lake, variant: str, start: int) -> list[Change]:
    """The changes the variant's topic holds from offset ``start`` on, in order."""
    topic = lake.topic(variant)
    try:
        high = lake.client.log_ends(topic)[0][2]
    except KafkaClientError:  # the connector has not created its topic yet
        return []
    out: list[Change] = []
    if high <= start:
        return out
    consumer = lake.client.range_consumer("cdc-lake-test")
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        deadline = time.monotonic() + 30
        while start + len(out) < high and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error() is not None:
                continue
            key, value = json.loads(msg.key() or b"null"), msg.value()
            envelope = json.loads(value) if value is not None else None
            if variant == "embedded":
                key = key["payload"]
                envelope = envelope["payload"] if envelope is not None else None
            out.append((envelope["op"] if envelope is not None else None, key["id"]))
    finally:
        consumer.close()
    return out


def highs(lake: Lake) -> dict[str, int]:
    """Each variant's topic's high watermark (0 before the topic exists)."""
    out = {}
    for variant in VARIANTS:
        try:
            out[variant] = lake.client.log_ends(lake.topic(variant))[0][2]
        except KafkaClientError:
            out[variant] = 0
    return out


def wait_until(
    lake: Lake, start: dict[str, int], done: Callable[[list[Change]], bool], what: str
) -> None:
    """Wait until each variant's topic holds, from ``start`` on, the changes ``done`` looks
    for: the connectors wrote a phase's changes (Debezium writes in commit order, and may
    write a change twice: a task that restarts sends again what it had not committed)."""
    deadline = time.monotonic() + 90
    while True:
        seen = {v: changes(lake, v, start[v]) for v in VARIANTS}
        if all(done(found) for found in seen.values()):
            return
        assert time.monotonic() < deadline, f"waiting for {what}, the topics hold {seen}"
        time.sleep(0.2)


def backfill(lake: Lake, name: str, hours: int) -> None:
    """Materialize the raw and current-state assets of both topics over the first ``hours``
    Kafka-time hours as one partition-range run, then record the phase."""
    assets = [a for s in lake.specs.values() for a in build_topic_assets(s)]
    last = lake.start + timedelta(hours=hours - 1)
    result = materialize_range(assets, lake.instance, lake.start, last, raise_on_error=False)
    failures = [str(e.event_specific_data)[:2000] for e in result.all_events if e.is_failure]
    checks = {
        f"{e.asset_key.to_user_string()}:{e.check_name}": e.passed
        for e in result.get_asset_check_evaluations()
    }
    ns = lake.settings.catalog.namespace
    current, deleted, raw, quarantined, offsets, unavailable = {}, {}, {}, {}, {}, {}
    for variant, s in lake.specs.items():
        current[variant], deleted[variant], unavailable[variant] = lake_rows(lake, variant)
        raw[variant] = sorted(
            r[0] for r in lake.spark.table(f"lake.{ns}.{s.raw_table}")
            .select("kafka_offset").collect()
        )  # fmt: skip
        quarantined[variant] = lake.spark.table(f"lake.{ns}.{s.quarantine_table}").count()
        offsets[variant] = kafka_offsets(lake, variant)
    lake.phases[name] = Phase(
        name, result.success, checks, source_rows(lake), current, deleted, raw, quarantined,
        offsets, unavailable, failures,
    )  # fmt: skip


def _row(lake: Lake, account_id: int, notes: int = 64) -> tuple[Any, ...]:
    return demo.row(account_id, lake.rng, notes_bytes=notes)


def _connectors(
    lake: Lake, suffix: str = "", snapshot_delay_ms: int = 0
) -> dict[str, dict[str, str]]:
    """Each variant's connector config (its own slot), stamped by the test clock."""
    out = {}
    for name, prefix, schemas in VARIANTS.values():
        ref = lake.source.worker.secret(f"{name}{suffix}.password", lake.db.password)
        config = debezium_postgres(
            lake.db, ref, topic_prefix=prefix, tables=["public.accounts"],
            slot=f"{prefix}{suffix.replace('-', '')}", schemas=schemas,
        )  # fmt: skip
        delay = {"snapshot.delay.ms": str(snapshot_delay_ms)} if snapshot_delay_ms else {}
        # Two connectors of one topic prefix in a worker: their JMX metrics need other names.
        tags = {"custom.metric.tags": f"connector={name}{suffix}"}
        out[f"{name}{suffix}"] = {**config, **delay, **tags, **lake.clock.overrides()}
    return out


Done = Callable[[list[Change]], bool]


def phase_snapshot(lake: Lake, start: dict[str, int]) -> Done:
    """Four rows (one with a 100 kB text), then both connectors: their snapshot reads."""
    lake.sql(
        (demo.DDL, ()), *[(demo.INSERT, _row(lake, i, BIG if i == 1 else 64)) for i in range(1, 5)]
    )
    for name, config in _connectors(lake).items():
        lake.source.worker.put_connector(name, config)
    return lambda found: {i for op, i in found if op == "r"} == {1, 2, 3, 4}


def phase_changes(lake: Lake, start: dict[str, int]) -> Done:
    """Creates, updates (one leaving the large text unchanged: TOAST), deletes, JSON nulls."""
    lake.sql(
        ("UPDATE accounts SET balance = balance + 0.01 WHERE id = 1", ()),  # notes unchanged
        (demo.INSERT, _row(lake, 5, BIG)),
        ("UPDATE accounts SET notes = %s WHERE id = 5", (_row(lake, 5, BIG)[5],)),
        ("DELETE FROM accounts WHERE id = 2", ()),
        (demo.INSERT, (*_row(lake, 6)[:3], None, None, None)),
        ("UPDATE accounts SET attrs = 'null'::jsonb, profile = '[1,  2]' WHERE id = 6", ()),
    )
    return lambda found: ("u", 6) in found


def phase_key_update(lake: Lake, start: dict[str, int]) -> Done:
    """A key update (delete, tombstone, create), and a key deleted and created again."""
    lake.sql(
        ("UPDATE accounts SET id = 30 WHERE id = 3", ()),
        ("DELETE FROM accounts WHERE id = 6", ()),
        (demo.INSERT, _row(lake, 6)),
    )
    return lambda found: ("c", 6) in found


def _slot_exists(lake: Lake, slot: str) -> bool:
    return bool(lake.query(f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}'"))


def phase_resnapshot(lake: Lake, start: dict[str, int]) -> Done:
    """New connectors on new slots write the same topics, their snapshot delayed: each makes
    its slot (the snapshot's position), then row 4 is updated and the old connectors write
    that change, and only then do the snapshot reads reach Kafka, at an older position; the
    new connectors stream the update again. Then the old connectors go, and one more change."""
    worker = lake.source.worker
    configs = _connectors(lake, "-2", snapshot_delay_ms=RESNAPSHOT_DELAY_MS)
    for name, config in configs.items():
        worker.put_connector(name, config)
    deadline = time.monotonic() + 60
    while not all(_slot_exists(lake, c["slot.name"]) for c in configs.values()):
        assert time.monotonic() < deadline, "the new connectors made no slot"
        time.sleep(0.1)
    lake.sql(("UPDATE accounts SET balance = balance - 1 WHERE id = 4", ()))
    ids = {row[0] for row in lake.query("SELECT id FROM accounts")}
    # Every row read again, and the update twice: by the old connectors, then the new ones.
    wait_until(
        lake,
        start,
        lambda found: {i for op, i in found if op == "r"} == ids and found.count(("u", 4)) >= 2,
        "the re-snapshot",
    )
    for name in _connectors(lake):
        worker.delete_connector(name)
    lake.sql(("UPDATE accounts SET balance = balance + 2 WHERE id = 5", ()))
    return lambda found: ("u", 5) in found


def phase_column_added(lake: Lake, start: dict[str, int]) -> Done:
    """A column added to the source, then set by an update (its large text unchanged) and an
    insert; the other rows hold NULL there, in the source as in Debezium's next reads."""
    lake.sql(
        ("ALTER TABLE accounts ADD COLUMN tier text", ()),
        ("UPDATE accounts SET tier = 'gold', balance = balance + 1 WHERE id = 1", ()),
        ("INSERT INTO accounts VALUES (%s, %s, %s, %s, %s, %s, 'silver')", _row(lake, 7)),
    )
    return lambda found: ("c", 7) in found


PHASE_RUNS: list[tuple[str, Callable[[Lake, dict[str, int]], Done]]] = [
    ("snapshot", phase_snapshot),
    ("changes", phase_changes),
    ("key update", phase_key_update),
    ("re-snapshot", phase_resnapshot),
    ("column added", phase_column_added),
]
# The last backfill: the column added to the spec, every hour again.
COLUMN_IN_SPEC = "column in spec"
ALL_PHASES = [name for name, _ in PHASE_RUNS] + [COLUMN_IN_SPEC]


@pytest.fixture(scope="module")
def lake(
    stack_settings: Settings, spark_session: SparkSession, cdc_source: SharedCdc
) -> Iterator[Lake]:
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=8)
    db = cdc_source.source.database(cdc_source.server, DATABASE, ROLE)
    clock = Clock(stack_settings.home / "lake-cdc-clock")
    specs = {variant: spec(variant, start) for variant in VARIANTS}
    with dg.instance_for_test() as instance:
        lake = Lake(
            stack_settings, spark_session, cdc_source, db, KafkaClient(stack_settings), clock,
            start, instance, specs,
        )  # fmt: skip
        try:
            for hour, (name, run) in enumerate(PHASE_RUNS):
                # This phase's records are stamped in its own hour, which ended hours ago.
                clock.at(start + timedelta(hours=hour, minutes=1))
                offsets = highs(lake)
                wait_until(lake, offsets, run(lake, offsets), name)
                backfill(lake, name, hour + 1)
            lake.specs = {v: spec(v, start, [{"name": "tier", "type": "string"}]) for v in VARIANTS}
            lake.columns.append("tier")
            backfill(lake, COLUMN_IN_SPEC, len(PHASE_RUNS))
            yield lake
        finally:
            _remove_connectors(lake)


def _remove_connectors(lake: Lake) -> None:
    """Delete this module's connectors and drop their slots (other modules share the source)."""
    worker = lake.source.worker
    for name in [*_connectors(lake), *_connectors(lake, "-2")]:
        if worker.connector_status(name) is not None:
            worker.delete_connector(name)
    slots = [
        c["slot.name"] for c in [*_connectors(lake).values(), *_connectors(lake, "-2").values()]
    ]
    deadline = time.monotonic() + 30
    con = lake.server.connect()
    try:
        with con.cursor() as cur:
            for slot in slots:
                while True:
                    cur.execute(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                    )
                    found = cur.fetchone()
                    if found is None:
                        break
                    if not found[0]:
                        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                        break
                    assert time.monotonic() < deadline, f"slot {slot} stays active"
                    time.sleep(0.2)
    finally:
        con.close()


@pytest.mark.parametrize("phase", ALL_PHASES)
def test_each_backfill_publishes_with_every_check_green(lake: Lake, phase: str) -> None:
    done = lake.phases[phase]
    assert done.success, done.failures
    assert done.checks and all(done.checks.values()), done.checks
    for variant in VARIANTS:
        raw = f"raw/{lake.specs[variant].name}"
        assert done.checks[f"{raw}:decoded_content"], variant


@pytest.mark.parametrize("phase", ALL_PHASES)
def test_the_current_state_equals_the_source_read_by_select(lake: Lake, phase: str) -> None:
    done = lake.phases[phase]
    assert done.source, "the source table is empty"
    for variant in VARIANTS:
        assert done.current[variant] == done.source, variant
        assert done.unavailable[variant] == 0, variant


@pytest.mark.parametrize("phase", ALL_PHASES)
def test_the_raw_table_holds_every_committed_record(lake: Lake, phase: str) -> None:
    done = lake.phases[phase]
    for variant in VARIANTS:
        raw = done.raw_offsets[variant]
        # Every committed record up to where the run's windows end, each once; a record the
        # connector wrote after the run sealed its hours belongs to a later window.
        assert raw == [o for o in done.kafka_offsets[variant] if o <= raw[-1]], variant
        assert done.quarantined[variant] == 0, variant


def _raw(lake: Lake, variant: str, account_id: int) -> list[dict[str, Any]]:
    """The raw table's rows of one key, in offset order."""
    ns = lake.settings.catalog.namespace
    table = lake.spark.table(f"lake.{ns}.{lake.specs[variant].raw_table}")
    rows = table.where(f"id = {account_id}").orderBy("kafka_offset").collect()
    return [r.asDict() for r in rows]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_deletes_and_a_key_update_remove_keys_for_good(lake: Lake, variant: str) -> None:
    """2 deleted, 3 moved to 30 (delete, tombstone, create), 6 deleted and created again: the
    re-snapshot after them brought none back."""
    last = lake.phases[COLUMN_IN_SPEC]
    assert {2, 3} <= last.deleted[variant]
    assert {2, 3}.isdisjoint(last.current[variant])
    assert {6, 30} <= set(last.current[variant])
    ops = [(r["cdc_op"], r["is_tombstone"]) for r in _raw(lake, variant, 3)]
    assert ops[-2:] == [("d", False), (None, True)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_unchanged_large_value_keeps_its_value(lake: Lake, variant: str) -> None:
    """The update that left row 1's 100 kB text alone is stored without it (named in
    cdc_unavailable); the current state keeps the text the snapshot read."""
    updates = [r for r in _raw(lake, variant, 1) if r["cdc_op"] == "u"]
    assert updates and all(r["notes"] is None for r in updates)
    assert {r["cdc_unavailable"] for r in updates} == {"notes"}
    notes = lake.phases[COLUMN_IN_SPEC].current[variant][1]["notes"]
    assert len(notes) == BIG and notes == lake.phases[COLUMN_IN_SPEC].source[1]["notes"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_snapshot_read_arriving_after_a_newer_change_does_not_win(
    lake: Lake, variant: str
) -> None:
    """Row 4: the new connector's snapshot read reached Kafka after the old connector's
    update of it, at an older LSN; the current state holds the update (LSN order)."""
    rows = _raw(lake, variant, 4)
    reads = [r for r in rows if r["cdc_op"] == "r"]
    update = next(r for r in rows if r["cdc_op"] == "u")
    stale = reads[-1]
    assert stale["kafka_offset"] > update["kafka_offset"]
    assert stale["cdc_lsn"] <= update["cdc_lsn"]  # the same LSN: the read is older
    # The read is the row as of its (older) position: by arrival it would undo the update.
    assert stale["balance"] == update["balance"] + 1
    resnapshot = lake.phases["re-snapshot"]
    assert resnapshot.current[variant][4]["balance"] == update["balance"]
    assert resnapshot.current[variant] == resnapshot.source


def test_a_column_added_to_the_source_appears_once_the_spec_names_it(lake: Lake) -> None:
    before, after = lake.phases["column added"], lake.phases[COLUMN_IN_SPEC]
    assert "tier" not in before.source[1] and "tier" not in before.current["none"][1]
    tiers = {i: row["tier"] for i, row in after.source.items()}
    assert tiers[1] == "gold" and tiers[7] == "silver" and tiers[4] is None
    for variant in VARIANTS:
        assert {i: row["tier"] for i, row in after.current[variant].items()} == tiers
