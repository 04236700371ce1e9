"""The CDC source runs here for real (issue 48): Debian's Postgres with logical decoding, Kafka
Connect from Maven Central against the session's broker, and Debezium's Postgres connector
(stack/cdc.py). What the connector writes is read back from Kafka and compared with the source
table read by ``SELECT``: snapshot reads, creates, updates, deletes each followed by a
tombstone, in source-log order, with Kafka's JSON converter with and without schemas.

The services start once for the session (the ``cdc_source`` fixture, shared with the lake's
CDC tests: support/cdc_source.py): Postgres in a temporary directory the ``postgres`` user can
enter, the worker under the session's BACKFILL_HOME, both on free ports; they are stopped by
PID at the end (the last test of the session checks that).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from backfill_assets.demo import cdc as demo
from backfill_assets.errors import KafkaClientError
from backfill_assets.stack import process
from backfill_assets.stack.cdc import CdcSource, PgSource
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.postgres import PgServer
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.cdc_source import SharedCdc

pytestmark = pytest.mark.cdc

BIG = 100_000  # characters of a large text value (stored out of line: TOAST)
# Debezium's placeholder for a TOASTed value an update left unchanged (REPLICA IDENTITY DEFAULT).
UNAVAILABLE = "__debezium_unavailable_value"
# Each variant: connector name, topic prefix (and slot), schemas.enable.
VARIANTS = {"schemas": ("shop-schemas", "shop_s", True), "plain": ("shop-plain", "shop_p", False)}
# What each topic holds in the end: two snapshot reads, then the changes, then a tombstone.
EXPECTED = 7


@dataclass
class Message:
    offset: int
    key: Any
    value: Any  # None: a tombstone

    def payload(self, schemas: bool) -> Any:
        if self.value is None:
            return None
        return self.value["payload"] if schemas else self.value


@dataclass
class Run:
    source: CdcSource
    server: PgServer
    db: PgSource
    rows: dict[int, tuple[Any, ...]]  # id -> the row as inserted (before any update)
    final: dict[int, dict[str, Any]]  # id -> the source's row by SELECT at the end
    messages: dict[str, list[Message]]  # variant -> its topic's records, in offset order
    client: KafkaClient


def _read(client: KafkaClient, topic: str, count: int, timeout_s: float = 90) -> list[Message]:
    """The first ``count`` records of ``topic`` (one partition), once they are all there."""
    deadline = time.monotonic() + timeout_s
    high = 0
    while time.monotonic() < deadline:
        try:
            high = client.log_ends(topic)[0][2]
        except KafkaClientError:  # the connector has not created its topic yet
            high = 0
        if high >= count:
            break
        time.sleep(0.25)
    else:
        pytest.fail(f"{topic} holds {high} records after {timeout_s:.0f}s, expected {count}")
    consumer = client.range_consumer("cdc-test", eof=False)
    out: list[Message] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error() is not None:
                continue
            key, value = msg.key(), msg.value()
            out.append(
                Message(
                    int(msg.offset() or 0),
                    json.loads(key) if key is not None else None,
                    json.loads(value) if value is not None else None,
                )
            )
    finally:
        consumer.close()
    assert len(out) == count
    return out


def _select(server: PgServer, db: PgSource) -> dict[int, dict[str, Any]]:
    con = server.connect(db.dbname, db.user, db.password)
    try:
        with con.cursor() as cur:
            cur.execute("SELECT * FROM accounts ORDER BY id")
            names = [d[0] for d in cur.description]
            return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}
    finally:
        con.close()


def _changes(server: PgServer, db: PgSource, rows: dict[int, tuple[Any, ...]]) -> None:
    """After both snapshots: create 3 (large text), update 1 leaving its large text alone,
    update 3's large text, delete 2; each statement its own transaction."""
    rng = random.Random(3)
    con = server.connect(db.dbname, db.user, db.password)
    try:
        with con.cursor() as cur:
            rows[3] = demo.row(3, rng, notes_bytes=BIG)
            cur.execute(demo.INSERT, rows[3])
            cur.execute("UPDATE accounts SET balance = balance + 0.01 WHERE id = 1")
            cur.execute("UPDATE accounts SET notes = %s WHERE id = 3", (demo.row(3, rng, BIG)[5],))
            cur.execute("DELETE FROM accounts WHERE id = 2")
    finally:
        con.close()


@pytest.fixture(scope="session")
def cdc_run(stack_settings: Settings, cdc_source: SharedCdc) -> Iterator[Run]:
    source, server = cdc_source.source, cdc_source.server
    db = source.database(server, "shop", "cdc")
    rng = random.Random(1)
    rows = {1: demo.row(1, rng, notes_bytes=BIG), 2: demo.row(2, rng)}
    con = server.connect(db.dbname, db.user, db.password)
    with con.cursor() as cur:
        cur.execute(demo.DDL)
        for values in rows.values():
            cur.execute(demo.INSERT, values)
    con.close()
    client = KafkaClient(stack_settings)
    for name, prefix, schemas in VARIANTS.values():
        source.connector(
            name, db, topic_prefix=prefix, tables=["public.accounts"], slot=prefix,
            schemas=schemas,
        )  # fmt: skip
    for _, prefix, _ in VARIANTS.values():  # both snapshots are in Kafka
        _read(client, f"{prefix}.public.accounts", 2)
    _changes(server, db, rows)
    messages = {
        variant: _read(client, f"{prefix}.public.accounts", EXPECTED)
        for variant, (_, prefix, _) in VARIANTS.items()
    }
    yield Run(source, server, db, rows, _select(server, db), messages, client)


def _ops(run: Run, variant: str) -> list[tuple[str | None, int]]:
    schemas = VARIANTS[variant][2]
    out = []
    for m in run.messages[variant]:
        key = m.key["payload"] if schemas else m.key
        payload = m.payload(schemas)
        out.append((payload["op"] if payload else None, key["id"]))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_snapshot_then_each_change_in_source_order(cdc_run: Run, variant: str) -> None:
    ops = _ops(cdc_run, variant)
    assert sorted(ops[:2]) == [("r", 1), ("r", 2)]
    assert ops[2:] == [("c", 3), ("u", 1), ("u", 3), ("d", 2), (None, 2)]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_source_lsn_orders_the_changes(cdc_run: Run, variant: str) -> None:
    """Snapshot reads carry the slot's starting LSN (the first change may start there too);
    every change after it a larger one, in Kafka's order."""
    schemas = VARIANTS[variant][2]
    payloads = [p for m in cdc_run.messages[variant] if (p := m.payload(schemas))]
    lsns = [p["source"]["lsn"] for p in payloads]
    assert all(isinstance(lsn, int) for lsn in lsns)
    assert lsns[0] == lsns[1] <= lsns[2] < lsns[3] < lsns[4] < lsns[5]
    assert [p["source"]["snapshot"] for p in payloads][2:] == ["false"] * 4
    assert {p["source"]["snapshot"] for p in payloads[:2]} <= {"first", "true", "last"}
    assert payloads[1]["source"]["snapshot"] == "last"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_delete_is_followed_by_a_tombstone_for_its_key(cdc_run: Run, variant: str) -> None:
    schemas = VARIANTS[variant][2]
    delete, tombstone = cdc_run.messages[variant][-2:]
    assert tombstone.value is None
    assert tombstone.key == delete.key
    assert tombstone.offset == delete.offset + 1
    payload = delete.payload(schemas)
    assert payload["after"] is None
    # REPLICA IDENTITY DEFAULT: Postgres logs the deleted row's key only. Debezium fills the
    # other columns of ``before`` with null, or, for a NOT NULL column, its type's zero (the
    # epoch for a timestamp): not the row's values, which a decoder must not take them for.
    assert payload["before"] == {
        "id": 2, "balance": "0.00", "updated_at": "1970-01-01T00:00:00Z", "attrs": None,
        "profile": None, "notes": None,
    }  # fmt: skip


def _as_source(after: dict[str, Any]) -> dict[str, Any]:
    """A Debezium ``after`` (decimal strings, ISO-8601 timestamps, JSON as text) as the values
    psycopg2 reads from the table."""
    return {
        "id": after["id"],
        "balance": Decimal(after["balance"]),
        "updated_at": datetime.fromisoformat(after["updated_at"]),
        "attrs": json.loads(after["attrs"]),
        "profile": json.loads(after["profile"]),
        "notes": after["notes"],
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_values_equal_the_source_read_by_select(cdc_run: Run, variant: str) -> None:
    schemas = VARIANTS[variant][2]
    by_op = {
        (p["op"], p["after"]["id"]): p["after"]
        for m in cdc_run.messages[variant]
        if (p := m.payload(schemas)) and p["after"]
    }
    final = cdc_run.final
    assert set(final) == {1, 3}
    # The last image of 3 is its row now; the snapshot's 1 was its row then (only the balance
    # changed since); 3 as created is the row inserted.
    assert _as_source(by_op[("u", 3)]) == final[3]
    assert _as_source(by_op[("r", 1)]) == {
        **final[1],
        "balance": final[1]["balance"] - Decimal("0.01"),
    }
    inserted = dict(zip(final[3], cdc_run.rows[3], strict=True))
    created = _as_source(by_op[("c", 3)])
    assert created["notes"] == inserted["notes"] and len(created["notes"]) == BIG
    assert created["balance"] == Decimal(inserted["balance"])
    assert created["updated_at"] == inserted["updated_at"]
    assert created["attrs"] == json.loads(inserted["attrs"])
    # Exact encodings: the numeric's scale kept, the timestamp in UTC with microseconds.
    assert by_op[("c", 3)]["balance"] == inserted["balance"]
    assert by_op[("c", 3)]["updated_at"].endswith("Z")
    assert datetime.fromisoformat(by_op[("c", 3)]["updated_at"]).utcoffset() == timedelta(0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_unchanged_large_value_is_not_repeated_by_an_update(cdc_run: Run, variant: str) -> None:
    """pgoutput leaves out a TOASTed value an update did not touch: Debezium writes its
    placeholder, which a decoder must not take for the value (REPLICA IDENTITY DEFAULT)."""
    schemas = VARIANTS[variant][2]
    update = next(
        p for m in cdc_run.messages[variant] if (p := m.payload(schemas)) and p["op"] == "u"
    )
    assert update["after"]["id"] == 1
    assert update["after"]["notes"] == UNAVAILABLE
    assert update["before"] is None
    assert Decimal(update["after"]["balance"]) == cdc_run.final[1]["balance"]


def test_the_schema_names_each_column_type(cdc_run: Run) -> None:
    first = cdc_run.messages["schemas"][0]
    assert first.key["schema"]["fields"] == [{"type": "int64", "optional": False, "field": "id"}]
    envelope = first.value["schema"]
    assert envelope["name"] == "shop_s.public.accounts.Envelope"
    after = next(f for f in envelope["fields"] if f["field"] == "after")
    types = {f["field"]: (f["type"], f.get("name")) for f in after["fields"]}
    assert types == {
        "id": ("int64", None),
        "balance": ("string", None),  # decimal.handling.mode=string
        "updated_at": ("string", "io.debezium.time.ZonedTimestamp"),
        "attrs": ("string", "io.debezium.data.Json"),
        "profile": ("string", "io.debezium.data.Json"),
        "notes": ("string", None),
    }
    plain = cdc_run.messages["plain"][0]
    assert set(plain.value) == {"before", "after", "source", "transaction", "op", "ts_ms",
                                "ts_us", "ts_ns"}  # fmt: skip
    assert set(plain.key) == {"id"}


def test_the_worker_keeps_the_password_out_of_the_connector_config(cdc_run: Run) -> None:
    worker = cdc_run.source.worker
    status = worker.status()
    assert status.ready
    mine = {k: v for k, v in status.connectors.items() if k.startswith("shop-")}
    assert mine == {"shop-schemas": "RUNNING", "shop-plain": "RUNNING"}
    config = worker.request("GET", "/connectors/shop-plain/config")
    assert config["database.password"].startswith("${file:")
    assert cdc_run.db.password not in json.dumps(config)
    assert (worker.secrets_path.stat().st_mode & 0o777) == 0o600


def test_postgres_decodes_logically_on_loopback_only(cdc_run: Run) -> None:
    con = cdc_run.server.connect()
    try:
        with con.cursor() as cur:
            settings = {}
            for name in ("wal_level", "listen_addresses"):
                cur.execute(f"SHOW {name}")
                settings[name] = cur.fetchone()[0]
            cur.execute("SELECT slot_name, plugin FROM pg_replication_slots ORDER BY 1")
            slots = cur.fetchall()
    finally:
        con.close()
    assert settings == {"wal_level": "logical", "listen_addresses": "127.0.0.1"}
    assert [s for s in slots if s[0].startswith("shop_")] == [
        ("shop_p", "pgoutput"),
        ("shop_s", "pgoutput"),
    ]


def test_the_demo_table_is_captured(cdc_run: Run) -> None:
    server, topic = demo.start(cdc_run.source)
    assert topic == "cdc_demo.public.accounts"
    messages = _read(cdc_run.client, topic, 5)
    db = cdc_run.source.database(server, demo.DATABASE, demo.ROLE)
    rows = _select(server, db)
    afters = {m.value["payload"]["after"]["id"]: m.value["payload"]["after"] for m in messages}
    assert {i: _as_source(a) for i, a in afters.items()} == rows
    assert {m.value["payload"]["op"] for m in messages} == {"r"}


@pytest.mark.stops_shared_services
def test_stop_ends_only_the_processes_it_started(cdc_run: Run) -> None:
    """Last in the session: the worker and the postmaster are stopped by their PIDs."""
    worker_pid = cdc_run.source.worker.running_pid()
    postgres_pid = cdc_run.source.postgres.running_pid()
    assert worker_pid is not None and postgres_pid == cdc_run.server.pid
    assert cdc_run.source.stop() == (True, True)
    assert not process.alive(worker_pid) and not process.alive(postgres_pid)
    assert cdc_run.source.stop() == (False, False)
