"""The lake reads the real Debezium's topics written in Avro through the schema registry (issue
48): Debezium's Postgres connector on the shared ``cdc_source`` worker, keys and values through
Apicurio Registry's Avro converter (``avro_converter``, jar set ``kafka-connect-avro``) against
the session's local registry, in Confluent's wire format; the topic is ``format: avro``,
``envelope: debezium``.

Two phases, each in its own Kafka-time hour (the test clock of support/cdc_source.py): the
snapshot of four rows (one with a 100 kB text); then creates, updates (one leaving that text
unchanged: TOAST), a delete with its tombstone, JSON nulls and a key update. Then one backfill
of both hours through Dagster (the raw and current-state assets, one partition-range run), and
the source read by ``SELECT`` compared row for row with the current-state table, the raw table
with the connector's committed records; nothing quarantined, every blocking check green
(``decoded_content``: the content check's own Avro decode agrees).
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.demo import cdc as demo
from backfill_assets.errors import KafkaClientError
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.cdc import PgSource, debezium_postgres
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.registry import LocalRegistry
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.cdc_source import Clock, SharedCdc
from backfill_assets_tests.support.runs import materialize_range

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.cdc

DATABASE, ROLE = "avro_cdc", "avrocdc"
CONNECTOR, PREFIX = "avro-a", "avro_a"
TOPIC = f"{PREFIX}.public.accounts"
BIG = 100_000  # characters of a large text value (stored out of line: TOAST)
COLUMNS: list[dict[str, Any]] = [
    {"name": "id", "type": "bigint", "nullable": False},
    {"name": "balance", "type": "decimal(12,2)", "nullable": False},
    {"name": "updated_at", "type": "timestamp", "nullable": False},
    {"name": "attrs", "type": "string"},
    {"name": "profile", "type": "string"},
    {"name": "notes", "type": "string"},
]
NAMES = [c["name"] for c in COLUMNS]


def spec(start: datetime) -> TopicSpec:
    """The spec entry docs/cdc.md gives for a Debezium topic in Avro."""
    return TopicSpec.model_validate(
        {
            "topic": TOPIC,
            "format": "avro",
            "envelope": "debezium",
            "key_field": "id",
            "partition_start": start.isoformat(),
            "allowed_lateness_hours": 0,
            "quarantine_max_ratio": 0.0,
            "columns": COLUMNS,
        }
    )


@dataclass
class World:
    settings: Settings
    spark: SparkSession
    cdc: SharedCdc
    db: PgSource
    client: KafkaClient
    registry: SchemaRegistryClient
    registry_url: str
    clock: Clock
    start: datetime
    spec: TopicSpec
    rng: random.Random = field(default_factory=lambda: random.Random(482))
    result: dg.ExecuteInProcessResult | None = None

    def sql(self, *statements: tuple[str, tuple[Any, ...]]) -> None:
        """Each statement in its own transaction."""
        con = self.cdc.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                for text, args in statements:
                    cur.execute(text, args)
        finally:
            con.close()

    def query(self, text: str) -> list[tuple[Any, ...]]:
        con = self.cdc.server.connect(self.db.dbname, self.db.user, self.db.password)
        try:
            with con.cursor() as cur:
                cur.execute(text)
                return list(cur.fetchall())
        finally:
            con.close()

    def table(self, name: str) -> Any:
        return self.spark.table(f"lake.{self.settings.catalog.namespace}.{name}")


Change = tuple[str | None, int]  # (op, or None for a tombstone; the key's id)


def records(world: World) -> list[tuple[int, bytes | None, bytes | None]]:
    """The topic's committed records (one partition): offset, key, value."""
    try:
        high = world.client.log_ends(TOPIC)[0][2]
    except KafkaClientError:  # the connector has not created its topic yet
        return []
    consumer = world.client.range_consumer("cdc-avro-test")
    out: list[tuple[int, bytes | None, bytes | None]] = []
    try:
        consumer.assign([TopicPartition(TOPIC, 0, 0)])
        deadline = time.monotonic() + 30
        while (not out or out[-1][0] < high - 1) and time.monotonic() < deadline and high:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                out.append((int(msg.offset() or 0), msg.key(), msg.value()))
    finally:
        consumer.close()
    return out


def changes(world: World) -> list[Change]:
    """The changes the topic holds, read with confluent-kafka's Avro deserializer: the
    converter wrote Confluent's wire format with ids the registry's ccompat API serves."""
    decode = AvroDeserializer(world.registry)
    out: list[Change] = []
    for _, key, value in records(world):
        envelope = decode(value, None) if value is not None else None
        out.append((envelope["op"] if envelope else None, decode(key, None)["id"]))
    return out


def wait_until(world: World, done: Callable[[list[Change]], bool], what: str) -> None:
    deadline = time.monotonic() + 90
    while True:
        found = changes(world)
        if done(found):
            return
        assert time.monotonic() < deadline, f"waiting for {what}, the topic holds {found}"
        time.sleep(0.3)


def _row(world: World, account_id: int, notes: int = 64) -> tuple[Any, ...]:
    return demo.row(account_id, world.rng, notes_bytes=notes)


def phase_snapshot(world: World) -> None:
    """Four rows (one with a 100 kB text), then the connector: its snapshot reads."""
    world.sql(
        (demo.DDL, ()),
        *[(demo.INSERT, _row(world, i, BIG if i == 1 else 64)) for i in range(1, 5)],
    )
    ref = world.cdc.source.worker.secret(f"{CONNECTOR}.password", world.db.password)
    config = debezium_postgres(
        world.db, ref, topic_prefix=PREFIX, tables=["public.accounts"], slot=PREFIX,
        schemas=False, avro_registry=world.registry_url,
    )  # fmt: skip
    tags = {"custom.metric.tags": f"connector={CONNECTOR}"}
    world.cdc.source.worker.put_connector(CONNECTOR, {**config, **tags, **world.clock.overrides()})
    wait_until(world, lambda found: {i for op, i in found if op == "r"} == {1, 2, 3, 4}, "reads")


def phase_changes(world: World) -> None:
    """Creates, updates (one leaving the large text unchanged: TOAST), a delete and its
    tombstone, JSON nulls, a key update (delete, tombstone, create)."""
    world.sql(
        ("UPDATE accounts SET balance = balance + 0.01 WHERE id = 1", ()),  # notes unchanged
        (demo.INSERT, _row(world, 5, BIG)),
        ("DELETE FROM accounts WHERE id = 2", ()),
        (demo.INSERT, (*_row(world, 6)[:3], None, None, None)),
        ("UPDATE accounts SET attrs = 'null'::jsonb, profile = '[1,  2]' WHERE id = 6", ()),
        ("UPDATE accounts SET id = 30 WHERE id = 3", ()),
    )
    wait_until(world, lambda found: ("c", 30) in found, "the changes")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def source_rows(world: World) -> dict[int, dict[str, Any]]:
    """The source table by ``SELECT``: json and jsonb as text, timestamps in epoch micros."""
    cols = ", ".join(f"{c}::text" if c in ("attrs", "profile") else c for c in NAMES)
    out = {}
    for row in world.query(f"SELECT {cols} FROM accounts"):
        values = dict(zip(NAMES, row, strict=True))
        values["updated_at"] = (values["updated_at"] - _EPOCH) // timedelta(microseconds=1)
        out[values["id"]] = values
    return out


def _remove_connector(world: World) -> None:
    """Delete the connector and drop its slot (other modules share the source)."""
    worker = world.cdc.source.worker
    if worker.connector_status(CONNECTOR) is not None:
        worker.delete_connector(CONNECTOR)
    deadline = time.monotonic() + 30
    con = world.cdc.server.connect()
    try:
        with con.cursor() as cur:
            while True:
                cur.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (PREFIX,)
                )
                found = cur.fetchone()
                if found is None:
                    break
                if not found[0]:
                    cur.execute("SELECT pg_drop_replication_slot(%s)", (PREFIX,))
                    break
                assert time.monotonic() < deadline, f"slot {PREFIX} stays active"
                time.sleep(0.2)
    finally:
        con.close()


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings,
    spark_session: SparkSession,
    cdc_source: SharedCdc,
    registry: LocalRegistry,
) -> Iterator[World]:
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=4)
    db = cdc_source.source.database(cdc_source.server, DATABASE, ROLE)
    clock = Clock(stack_settings.home / "avro-cdc-clock")
    w = World(
        stack_settings, spark_session, cdc_source, db, KafkaClient(stack_settings),
        SchemaRegistryClient({"url": registry.url}), registry.url, clock, start, spec(start),
    )  # fmt: skip
    try:
        for hour, run in enumerate((phase_snapshot, phase_changes)):
            clock.at(start + timedelta(hours=hour, minutes=1))
            run(w)
        with dg.instance_for_test() as instance:
            w.result = materialize_range(
                build_topic_assets(w.spec), instance, start, start + timedelta(hours=1),
                raise_on_error=False,
            )  # fmt: skip
        yield w
    finally:
        _remove_connector(w)


def test_the_converter_writes_confluents_wire_format(world: World) -> None:
    """Keys and values: magic byte 0 and a 4-byte id the registry's ccompat API serves, under
    subjects <topic>-key and <topic>-value; a tombstone keeps its Avro key."""
    found = records(world)
    assert found
    for _, key, value in found:
        for data in (key, value):
            if data is None:
                continue
            assert data[0] == 0
            (sid,) = struct.unpack(">I", data[1:5])
            assert world.registry.get_schema(sid).schema_type in ("AVRO", None)
    assert any(value is None and key for _, key, value in found)
    subjects = set(world.registry.get_subjects())
    assert {f"{TOPIC}-key", f"{TOPIC}-value"} <= subjects


def test_the_backfill_publishes_with_every_check_green(world: World) -> None:
    result = world.result
    assert result is not None
    failures = [str(e.event_specific_data)[:2000] for e in result.all_events if e.is_failure]
    assert result.success, failures
    checks = {
        f"{e.asset_key.to_user_string()}:{e.check_name}": e.passed
        for e in result.get_asset_check_evaluations()
    }
    assert checks and all(checks.values()), checks
    assert checks[f"raw/{world.spec.name}:decoded_content"]


def test_the_current_state_equals_the_source_read_by_select(world: World) -> None:
    from pyspark.sql import functions as F

    rows = (
        world.table(world.spec.current_table)
        .withColumn("updated_at", F.unix_micros("updated_at"))
        .collect()
    )
    live = {r["id"]: {c: r[c] for c in NAMES} for r in rows if not r["deleted"]}
    source = source_rows(world)
    assert set(source) == {1, 4, 5, 6, 30}
    assert live == source
    assert {r["id"] for r in rows if r["deleted"]} == {2, 3}
    assert all(r["cdc_unavailable"] is None for r in rows)
    assert len(live[1]["notes"]) == BIG  # kept from the snapshot read across the update


def test_the_raw_table_holds_every_committed_record_and_nothing_is_quarantined(
    world: World,
) -> None:
    raw = world.table(world.spec.raw_table)
    offsets = sorted(r[0] for r in raw.select("kafka_offset").collect())
    assert offsets == [o for o, _, _ in records(world) if o <= offsets[-1]]
    assert world.table(world.spec.quarantine_table).count() == 0
    ops = [
        (r["cdc_op"], r["is_tombstone"], r["cdc_unavailable"])
        for r in raw.where("id = 3").orderBy("kafka_offset").collect()
    ]
    assert ops == [("r", False, None), ("d", False, None), (None, True, None)]
    update = raw.where("id = 1 AND cdc_op = 'u'").collect()
    assert [(r["notes"], r["cdc_unavailable"]) for r in update] == [(None, "notes")]
