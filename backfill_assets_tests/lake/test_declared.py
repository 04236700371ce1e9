"""Declared tables on a second topic added by spec only: a `payments` topic with its own columns,
no upcasters and no version field, three SQL tables (one reading another) whose rows equal a
ground truth computed from what was produced (duplicates, corrections, a tombstone and malformed
records included); broken declarations fail loading with a clear message; and each blocking
check of a declared table keeps a subtly wrong table from being published."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
import pytest
import yaml
from confluent_kafka import Message, Producer

# NewTopic and AdminClient are public but only implicitly re-exported.
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import build_topic_assets
from backfill_assets.demo.generator import TOPIC_CONFIGS
from backfill_assets.errors import SpecError
from backfill_assets.spec.loader import load_specs
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support.runs import materialize_range
from backfill_assets_tests.support.versions import newest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T0 = datetime(2026, 3, 2, tzinfo=UTC)
FIRST, LAST = "2026-03-02-00:00", "2026-03-02-03:00"  # Kafka hours 00..03, event hours 00..03
END = T0 + timedelta(hours=4)
PARTITIONS = 3
METHODS = ("card", "bank", "wallet")
BIG = 10_000  # pay_big: captured payments of at least this many cents
BUSY = 30_000  # pay_busy: (hour, method) cells whose total exceeds this

HOURLY_SQL = """
-- Payments per event-time hour and method.
SELECT
  date_trunc('HOUR', paid_at)          AS pay_hour,
  method,
  count(*)                             AS payments,
  CAST(sum(amount_cents) AS BIGINT)    AS amount_cents,
  sum(fee)                             AS fees,
  count_if(captured)                   AS captured
FROM {topic}
WHERE paid_at >= {{start}} AND paid_at < {{end}}
GROUP BY date_trunc('HOUR', paid_at), method
"""
BIG_SQL = """
SELECT p.txn_id, p.account, p.method, p.amount_cents, p.paid_at
FROM {topic} AS p
WHERE p.paid_at >= {{start}} AND p.paid_at < {{end}}
  AND p.captured AND p.amount_cents >= {big}
"""
BUSY_SQL = """
SELECT pay_hour, method, amount_cents
FROM {hourly}
WHERE pay_hour >= {{start}} AND pay_hour < {{end}} AND amount_cents > {busy}
"""


def _col(name: str, ctype: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": ctype, "nullable": False, **extra}


def _topic_entry(topic: str, tables: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "topic": topic,
        "format": "json",
        "key_field": "account",
        "event_id_field": "txn_id",
        "event_time_field": "paid_at",
        "partition_start": T0.isoformat(),
        "allowed_lateness_hours": 1,
        # Judged per Kafka hour: the hour holding the malformed records has 3 of 10.
        "quarantine_max_ratio": 0.35,
        "columns": [
            _col("txn_id", "string"),
            _col("account", "string"),
            _col("method", "string", allowed=list(METHODS)),
            _col("amount_cents", "bigint", min=0),
            _col("fee", "double"),
            _col("captured", "boolean"),
            _col("paid_at", "timestamp"),
        ],
        "tables": tables,
    }


@dataclasses.dataclass(frozen=True)
class Names:
    topic: str
    hourly: str
    big: str
    busy: str


def _names() -> Names:
    s = uuid.uuid4().hex[:8]
    return Names(f"payments_{s}", f"pay_hourly_{s}", f"pay_big_{s}", f"pay_busy_{s}")


def _write_spec(directory: Path, n: Names) -> Path:
    """The payments spec: SQL files next to the yaml; pay_busy (reading pay_hourly) is listed
    first, so only the dependency order can run it after pay_hourly."""
    directory.mkdir(parents=True, exist_ok=True)
    sql = directory / "sql"
    sql.mkdir(exist_ok=True)
    (sql / "hourly.sql").write_text(HOURLY_SQL.format(topic=n.topic))
    (sql / "big.sql").write_text(BIG_SQL.format(topic=n.topic, big=BIG))
    (sql / "busy.sql").write_text(BUSY_SQL.format(hourly=n.hourly, busy=BUSY))
    tables = [
        {
            "name": n.busy,
            "sql": "sql/busy.sql",
            "event_time": "pay_hour",
            "grain": ["pay_hour", "method"],
            "source": n.hourly,
            "columns": [
                _col("pay_hour", "timestamp"),
                _col("method", "string", allowed=list(METHODS)),
                _col("amount_cents", "bigint", min=BUSY + 1),
            ],
            "measures": [
                {
                    "name": "amount_cents",
                    "source": f"sum(CASE WHEN amount_cents > {BUSY} THEN amount_cents END)",
                },
                {
                    "name": "cells",
                    "table": "count(*)",
                    "source": f"count_if(amount_cents > {BUSY})",
                },
            ],
        },
        {
            "name": n.hourly,
            "description": "Payments per event hour and method.",
            "sql": "sql/hourly.sql",
            "event_time": "pay_hour",
            "grain": ["pay_hour", "method"],
            "columns": [
                _col("pay_hour", "timestamp"),
                _col("method", "string", allowed=list(METHODS)),
                _col("payments", "bigint", min=1),
                _col("amount_cents", "bigint", min=0),
                _col("fees", "double"),
                _col("captured", "bigint", min=0),
            ],
            "measures": [
                {"name": "payments", "table": "sum(payments)", "source": "count(*)"},
                "amount_cents",
                {"name": "fees", "table": "sum(fees)", "source": "sum(fee)"},
                {"name": "captured", "source": "count_if(captured)"},
            ],
        },
        {
            "name": n.big,
            "sql": "sql/big.sql",
            "event_time": "paid_at",
            "grain": ["txn_id"],
            "columns": [
                _col("txn_id", "string"),
                _col("account", "string"),
                _col("method", "string", allowed=list(METHODS)),
                _col("amount_cents", "bigint", min=BIG),
                _col("paid_at", "timestamp"),
            ],
            "measures": [
                {
                    "name": "rows",
                    "table": "count(*)",
                    "source": f"count_if(captured AND amount_cents >= {BIG})",
                },
            ],
        },
    ]
    path = directory / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": [_topic_entry(n.topic, tables)]}, sort_keys=False))
    return path


# --------------------------------------------------------------------------------------------
# Producing, and the ground truth of what was produced


@dataclasses.dataclass(frozen=True)
class Produced:
    key: str
    payload: dict[str, Any] | None  # None: a tombstone
    paid_at: datetime | None
    timestamp_ms: int
    partition: int
    offset: int
    valid: bool  # False: malformed, must be quarantined


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _plan() -> list[tuple[str, bytes | None, int, int, dict[str, Any] | None, datetime | None]]:
    """(key, value, kafka ms, partition, payload or None, paid_at) in produce order."""
    rng = random.Random(7)
    out: list[tuple[str, bytes | None, int, int, dict[str, Any] | None, datetime | None]] = []

    def event(
        i: int, paid_at: datetime, kafka: datetime, partition: int, **over: Any
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "txn_id": f"t-{i:03d}",
            "account": f"a-{i % 6}",
            "method": METHODS[i % 3],
            "amount_cents": rng.randrange(100, 20_000),
            "fee": rng.randrange(0, 200) / 4,  # quarters: sums are exact in binary
            "captured": rng.random() < 0.6,
            # Half the events carry epoch milliseconds, half ISO-8601 text with an offset.
            "paid_at": _ms(paid_at)
            if i % 2 == 0
            else paid_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
            if i % 4 == 1
            else paid_at.astimezone(UTC).isoformat(timespec="milliseconds"),
            **over,
        }
        out.append(
            (
                payload["account"],
                json.dumps(payload).encode(),
                _ms(kafka),
                partition,
                payload,
                paid_at,
            )
        )
        return payload

    firsts: dict[int, tuple[dict[str, Any], datetime, datetime, int]] = {}
    for i in range(36):
        paid_at = T0 + timedelta(minutes=rng.randrange(0, 180), seconds=rng.randrange(60))
        kafka = paid_at + timedelta(minutes=rng.randrange(0, 40))
        part = rng.randrange(PARTITIONS)
        firsts[i] = (event(i, paid_at, kafka, part), paid_at, kafka, part)

    def again(i: int, kafka: datetime, partition: int, **over: Any) -> None:
        payload, paid_at, _, _ = firsts[i]
        body = {**payload, **over}
        out.append(
            (body["account"], json.dumps(body).encode(), _ms(kafka), partition, body, paid_at)
        )

    late = T0 + timedelta(hours=3, minutes=20)
    again(3, late, 0)  # an identical re-send (same content, later): collapses
    again(5, late, 1, amount_cents=15_000, captured=True, fee=1.25)  # a correction: wins
    # A correction produced after the first version, in its partition, stamped a minute
    # earlier (a slow clock): the later offset wins, whatever the stamps say.
    again(7, firsts[7][2] - timedelta(minutes=1), firsts[7][3], amount_cents=1)
    # Same Kafka time, two partitions, different content: the higher partition wins.
    again(9, late, 0, amount_cents=11)
    again(9, late, 2, amount_cents=19_999, captured=True)
    # Malformed records: quarantined, never in any table.
    out.append(("a-1", b'{"txn_id": "t-bad-1", "amount_', _ms(late), 1, None, None))
    bad = {**firsts[11][0], "txn_id": "t-bad-2", "method": "cash"}
    out.append(("a-2", json.dumps(bad).encode(), _ms(late), 2, None, None))
    neg = {**firsts[12][0], "txn_id": "t-bad-3", "amount_cents": -5}
    out.append(("a-3", json.dumps(neg).encode(), _ms(late), 0, None, None))
    # Tombstones: a-3 is deleted after its last payment; a-4 is deleted before new payments.
    out.append(("a-3", None, _ms(T0 + timedelta(hours=3, minutes=30)), 1, None, None))
    out.append(("a-4", None, _ms(T0 + timedelta(minutes=1)), 2, None, None))
    return out


def _produce(settings: Settings, topic: str) -> list[Produced]:
    admin = AdminClient(dict(settings.kafka.client_config()))
    new = NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1, config=TOPIC_CONFIGS)
    admin.create_topics([new])[topic].result(30)
    producer = Producer({**settings.kafka.client_config(), "enable.idempotence": True})
    plan = _plan()
    offsets: dict[int, tuple[int, int]] = {}

    for index, (key, value, ts, partition, _, _) in enumerate(plan):

        def report(err: Any, msg: Message, index: int = index) -> None:
            assert err is None, err
            offsets[index] = (msg.partition() or 0, msg.offset() or 0)

        producer.produce(
            topic,
            key=key.encode(),
            value=value,
            partition=partition,
            timestamp=ts,
            on_delivery=report,
        )
        producer.flush(30)  # one at a time: offsets follow the plan order per partition
    assert len(offsets) == len(plan)
    return [
        Produced(
            key,
            payload,
            paid_at,
            ts,
            offsets[i][0],
            offsets[i][1],
            valid=value is None or payload is not None,
        )
        for i, (key, value, ts, _, payload, paid_at) in enumerate(plan)
    ]


def _winners(records: list[Produced]) -> dict[str, Produced]:
    """Per txn_id, the version the version rule picks (support.versions.newest)."""
    by_id: dict[str, list[Produced]] = defaultdict(list)
    for r in records:
        if r.payload is not None:
            by_id[r.payload["txn_id"]].append(r)
    return {tid: newest(versions, _position) for tid, versions in by_id.items()}


def _position(r: Produced) -> tuple[int, int, int]:
    return (r.timestamp_ms, r.partition, r.offset)


def _hour(moment: datetime) -> datetime:
    return moment.replace(minute=0, second=0, microsecond=0)


def _utc(value: datetime) -> datetime:
    """A timestamp PySpark returned (naive, in the machine's zone) as an aware UTC datetime."""
    return value.astimezone(UTC)


Cell = tuple[datetime, str]


def _expected_hourly(winners: dict[str, Produced]) -> dict[Cell, tuple[int, int, float, int]]:
    acc: dict[Cell, list[Any]] = defaultdict(lambda: [0, 0, 0.0, 0])
    for r in winners.values():
        assert r.payload is not None and r.paid_at is not None
        if not T0 <= r.paid_at < END:
            continue
        cell = acc[(_hour(r.paid_at), r.payload["method"])]
        cell[0] += 1
        cell[1] += r.payload["amount_cents"]
        cell[2] += r.payload["fee"]
        cell[3] += int(r.payload["captured"])
    return {k: (v[0], v[1], v[2], v[3]) for k, v in acc.items()}


def _expected_current(records: list[Produced]) -> dict[str, tuple[bool, str | None, int | None]]:
    """Per account: the latest of the winning events (by paid_at) and the tombstones (by Kafka
    time), then the version rule: (deleted, txn_id, amount_cents)."""
    winners = _winners(records)
    candidates = [*winners.values(), *(r for r in records if r.valid and r.payload is None)]
    by_key: dict[str, list[Produced]] = defaultdict(list)
    for r in candidates:
        by_key[r.key].append(r)

    def order(r: Produced) -> int:
        return _ms(r.paid_at) if r.paid_at is not None else r.timestamp_ms

    latest = {k: newest(rows, _position, first=order) for k, rows in by_key.items()}
    return {
        k: (
            r.payload is None,
            r.payload["txn_id"] if r.payload else None,
            r.payload["amount_cents"] if r.payload else None,
        )
        for k, r in latest.items()
    }


# --------------------------------------------------------------------------------------------
# The world: one topic, produced once, raw + current + declared tables materialized in one run


@dataclasses.dataclass
class World:
    names: Names
    spec: TopicSpec
    records: list[Produced]
    ns: str
    instance: dg.DagsterInstance
    directory: Path
    result: dg.ExecuteInProcessResult


def _materialize(
    assets: list[dg.AssetsDefinition], instance: dg.DagsterInstance, first: str, last: str
) -> dg.ExecuteInProcessResult:
    return materialize_range(assets, instance, first, last, raise_on_error=False)


@pytest.fixture(scope="module")
def world(
    stack_settings: Settings,
    spark_session: SparkSession,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[World]:
    names = _names()
    directory = tmp_path_factory.mktemp("payments")
    (spec,) = load_specs(_write_spec(directory, names))
    records = _produce(stack_settings, names.topic)
    with dg.instance_for_test() as instance:
        assets = build_topic_assets(spec, [spec])
        result = _materialize(assets, instance, FIRST, LAST)
        yield World(
            names,
            spec,
            records,
            f"lake.{stack_settings.catalog.namespace}",
            instance,
            directory,
            result,
        )


def test_spec_only_topic_loads_with_dependency_order(tmp_path: Path) -> None:
    n = _names()
    (spec,) = load_specs(_write_spec(tmp_path, n))
    from backfill_assets.spec import declared

    assert spec.version_field is None and not spec.upcasters and spec.latest_version == 1
    order = [t.name for t in declared.ordered([spec])]
    assert order.index(n.hourly) < order.index(n.busy), order
    busy = next(t for t in spec.tables if t.name == n.busy)
    assert busy.refs == (n.hourly,)
    assert busy.lateness_hours == 1 and busy.lookback_hours == 0
    assets = build_topic_assets(spec, [spec])
    keys = [a.key.to_user_string() for a in assets]
    assert keys == [
        f"raw/{n.topic}",
        f"lakehouse/{n.topic}_current",
        f"lakehouse/{n.busy}",
        f"lakehouse/{n.hourly}",
        f"lakehouse/{n.big}",
    ]
    busy_asset = assets[2]
    deps = {d.asset_key for d in busy_asset.specs_by_key[busy_asset.key].deps}
    assert deps == {dg.AssetKey(["lakehouse", n.hourly])}


def test_every_asset_materialized_and_every_check_passed(world: World) -> None:
    result = world.result
    assert result.success, [e.message for e in result.get_step_failure_events()]
    done = {
        e.asset_key.to_user_string()
        for e in result.get_asset_materialization_events()
        if e.asset_key is not None
    }
    n = world.names
    for table in (n.hourly, n.big, n.busy, f"{n.topic}_current"):
        assert f"lakehouse/{table}" in done
    evaluations = result.get_asset_check_evaluations()
    failed = [(e.asset_key.to_user_string(), e.check_name) for e in evaluations if not e.passed]
    assert not failed
    checked = {(e.asset_key.path[-1], e.check_name) for e in evaluations}
    for table in (n.hourly, n.big, n.busy):
        for check in ("schema_contract", "uniqueness", "reconciliation"):
            assert (table, check) in checked, (table, check)
    assert (n.topic, "quarantine_ratio") in checked


def test_declared_tables_equal_ground_truth(world: World, spark_session: SparkSession) -> None:
    assert world.result.success
    n = world.names
    winners = _winners(world.records)
    # The hostile cases resolved as the rule says (a check on the ground truth itself).
    assert winners["t-005"].payload is not None and winners["t-005"].payload["amount_cents"] == (
        15_000
    )
    assert winners["t-007"].payload is not None and winners["t-007"].payload["amount_cents"] == 1
    assert winners["t-009"].payload is not None and winners["t-009"].payload["amount_cents"] == (
        19_999
    )

    hourly = {
        (_utc(r["pay_hour"]), r["method"]): (
            r["payments"],
            r["amount_cents"],
            r["fees"],
            r["captured"],
        )
        for r in spark_session.table(f"{world.ns}.{n.hourly}").collect()
    }
    expected_hourly = _expected_hourly(winners)
    assert len(expected_hourly) >= 6
    assert hourly == expected_hourly

    big = {
        r["txn_id"]: (r["account"], r["method"], r["amount_cents"], r["paid_at_ms"])
        for r in spark_session.sql(
            f"SELECT *, unix_millis(paid_at) AS paid_at_ms FROM {world.ns}.{n.big}"
        ).collect()
    }
    expected_big = {
        tid: (p["account"], p["method"], p["amount_cents"], _ms(r.paid_at))
        for tid, r in winners.items()
        if (p := r.payload) is not None
        and r.paid_at is not None
        and p["captured"]
        and p["amount_cents"] >= BIG
    }
    assert {"t-005", "t-009"} <= set(expected_big)
    assert big == expected_big

    busy = {
        (_utc(r["pay_hour"]), r["method"]): r["amount_cents"]
        for r in spark_session.table(f"{world.ns}.{n.busy}").collect()
    }
    expected_busy = {k: v[1] for k, v in expected_hourly.items() if v[1] > BUSY}
    assert 0 < len(expected_busy) < len(expected_hourly)
    assert busy == expected_busy


def test_current_state_is_latest_per_account(world: World, spark_session: SparkSession) -> None:
    assert world.result.success
    rows = spark_session.table(f"{world.ns}.{world.names.topic}_current").collect()
    state = {r["account"]: (r["deleted"], r["txn_id"], r["amount_cents"]) for r in rows}
    expected = _expected_current(world.records)
    assert expected["a-3"] == (True, None, None)
    assert expected["a-4"][0] is False  # deleted first, then paid again
    assert state == expected


def test_malformed_records_are_quarantined(world: World, spark_session: SparkSession) -> None:
    assert world.result.success
    reasons = sorted(
        r["reason"]
        for r in spark_session.table(f"{world.ns}.{world.spec.quarantine_table}").collect()
    )
    assert len(reasons) == sum(1 for r in world.records if not r.valid)
    assert any(r.startswith("not_allowed:method") for r in reasons), reasons
    assert any(r.startswith("below_min:amount_cents") for r in reasons), reasons
    raw_ids = {
        r["txn_id"]
        for r in spark_session.table(f"{world.ns}.{world.spec.raw_table}").collect()
        if r["txn_id"] is not None
    }
    assert not {i for i in raw_ids if i.startswith("t-bad")}


# --------------------------------------------------------------------------------------------
# Broken declarations fail loading, naming the topic, the table and the culprit


def _edit_sql(directory: Path, name: str, old: str, new: str) -> None:
    path = directory / "sql" / name
    text = path.read_text()
    assert old in text, (old, text)
    path.write_text(text.replace(old, new))


def _edit_table(directory: Path, table: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "topics.yaml"
    doc = yaml.safe_load(path.read_text())
    change(next(t for t in doc["topics"][0]["tables"] if t["name"] == table))
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _retype(column: str, ctype: str) -> Callable[[dict[str, Any]], None]:
    def change(table: dict[str, Any]) -> None:
        next(c for c in table["columns"] if c["name"] == column)["type"] = ctype

    return change


KINDS = (
    "unknown_column",
    "missing_end",
    "grain_not_declared",
    "type_mismatch",
    "unknown_relation",
    "measure_unknown_column",
    "cycle",
)


def _break(d: Path, n: Names, kind: str) -> tuple[str, str]:
    """Break one declaration; return the broken table and the culprit the message must name."""
    culprits = {
        "unknown_column": (n.hourly, "tip_cents"),
        "missing_end": (n.big, "{end}"),
        "grain_not_declared": (n.big, "channel"),
        "type_mismatch": (n.hourly, "payments"),
        "unknown_relation": (n.big, "refunds"),
        "measure_unknown_column": (n.hourly, "tip_cents"),
        "cycle": (n.hourly, n.busy),
    }
    if kind == "unknown_column":
        _edit_sql(d, "hourly.sql", "sum(fee)", "sum(tip_cents)")
    elif kind == "missing_end":
        _edit_sql(d, "big.sql", "p.paid_at < {end}", "p.paid_at < {start} + INTERVAL 1 HOUR")
    elif kind == "grain_not_declared":
        _edit_table(d, n.big, lambda t: t.update(grain=["txn_id", "channel"]))
    elif kind == "type_mismatch":  # count(*) is a BIGINT, declared string
        _edit_table(d, n.hourly, _retype("payments", "string"))
    elif kind == "unknown_relation":
        _edit_sql(d, "big.sql", f"FROM {n.topic} AS p", "FROM refunds AS p")
    elif kind == "measure_unknown_column":
        _edit_table(d, n.hourly, lambda t: t["measures"].append("tip_cents"))
    else:  # pay_hourly now also reads pay_busy, which reads pay_hourly
        assert kind == "cycle"
        sub = f"AND method IN (SELECT method FROM {n.busy})\nGROUP BY"
        _edit_sql(d, "hourly.sql", "GROUP BY", sub)
    return culprits[kind]


def _broken(directory: Path, kind: str) -> tuple[Path, Names, str, str]:
    n = _names()
    path = _write_spec(directory, n)
    load_specs(path)  # the unbroken spec loads: only the breakage below fails it
    table, culprit = _break(directory, n, kind)
    return path, n, table, culprit


@pytest.mark.parametrize("kind", KINDS)
def test_broken_declaration_fails_loading(tmp_path: Path, kind: str) -> None:
    path, n, table, culprit = _broken(tmp_path, kind)
    with pytest.raises(SpecError) as err:
        load_specs(path)
    message = str(err.value)
    for part in (n.topic, table, culprit):
        assert part in message, f"{part!r} not in {message!r}"


def test_definitions_validate_fails_on_a_broken_spec(tmp_path: Path) -> None:
    path, n, table, _ = _broken(tmp_path, "unknown_relation")
    with pytest.raises(SpecError) as err:
        load_specs(path)
    dagster = Path(sys.executable).with_name("dagster")
    home = tmp_path / "dagster_home"  # an empty instance: nothing but the spec is needed
    home.mkdir()
    proc = subprocess.run(
        [str(dagster), "definitions", "validate", "-m", "backfill_assets.defs.definitions"],
        check=False,
        cwd=REPO_ROOT,
        env={**os.environ, "BACKFILL_SPEC": str(path), "DAGSTER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert str(err.value).splitlines()[0] in output, output[-3000:]
    assert "refunds" in output and n.topic in output and table in output


# --------------------------------------------------------------------------------------------
# Each blocking check of a declared table keeps a wrong table off main


def test_each_declared_check_blocks_its_publish(
    world: World, spark_session: SparkSession, tmp_path: Path
) -> None:
    assert world.result.success
    s = uuid.uuid4().hex[:8]
    t = world.names.topic
    window = "paid_at >= {start} AND paid_at < {end}"
    hour = "date_trunc('HOUR', paid_at)"
    per_cell = [
        _col("pay_hour", "timestamp"),
        _col("method", "string", allowed=list(METHODS)),
        _col("payments", "bigint", min=1),
    ]
    count_measure = {"name": "payments", "table": "sum(payments)", "source": "count(*)"}
    txn_cols = [
        _col("txn_id", "string"),
        _col("amount_cents", "bigint", min=0),
        _col("paid_at", "timestamp"),
    ]
    tables = {
        # Drops the wallet payments the measure counts.
        f"bad_recon_{s}": (
            f"SELECT {hour} AS pay_hour, method, count(*) AS payments FROM {t} "
            f"WHERE {window} AND method <> 'wallet' GROUP BY {hour}, method",
            "pay_hour",
            ["pay_hour", "method"],
            per_cell,
            [count_measure],
        ),
        # Declares one row per hour but keeps one per hour and method.
        f"bad_grain_{s}": (
            f"SELECT {hour} AS pay_hour, method, count(*) AS payments FROM {t} "
            f"WHERE {window} GROUP BY {hour}, method",
            "pay_hour",
            ["pay_hour"],
            per_cell,
            [count_measure],
        ),
        # Subtracts a fee from amounts declared >= 0 (its measure agrees, so only the
        # contract can catch it).
        f"bad_contract_{s}": (
            f"SELECT txn_id, amount_cents - 5000 AS amount_cents, paid_at FROM {t} WHERE {window}",
            "paid_at",
            ["txn_id"],
            txn_cols,
            [{"name": "amount_cents", "source": "sum(amount_cents - 5000)"}],
        ),
        f"good_{s}": (
            f"SELECT txn_id, amount_cents, paid_at FROM {t} WHERE {window}",
            "paid_at",
            ["txn_id"],
            txn_cols,
            ["amount_cents"],
        ),
    }
    entries = []
    for name, (sql, event_time, grain, columns, measures) in tables.items():
        (tmp_path / f"{name}.sql").write_text(sql)
        entries.append(
            {
                "name": name,
                "sql": f"{name}.sql",
                "event_time": event_time,
                "grain": grain,
                "columns": columns,
                "measures": measures,
            }
        )
    path = tmp_path / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": [_topic_entry(t, entries)]}, sort_keys=False))
    (spec,) = load_specs(path)
    declared_assets = build_topic_assets(spec, [spec])[2:]
    assert [a.key.path[-1] for a in declared_assets] == list(tables)

    # The faults are real in this data: wallet payments exist, and an hour has two methods.
    winners = [
        r.payload
        for r in _winners(world.records).values()
        if r.payload is not None and r.paid_at is not None and T0 <= r.paid_at < END
    ]
    assert any(p["method"] == "wallet" for p in winners)
    assert any(p["amount_cents"] < 5000 for p in winners)
    methods_per_hour: dict[datetime, set[str]] = defaultdict(set)
    for r in _winners(world.records).values():
        if r.payload is not None and r.paid_at is not None:
            methods_per_hour[_hour(r.paid_at)].add(r.payload["method"])
    assert any(len(m) > 1 for m in methods_per_hour.values())

    result = _materialize(declared_assets, world.instance, FIRST, LAST)
    assert not result.success
    failed_steps = {e.step_key for e in result.get_step_failure_events()}
    evaluations = result.get_asset_check_evaluations()
    failed_checks = {(e.asset_key.path[-1], e.check_name) for e in evaluations if not e.passed}
    assert failed_checks == {
        (f"bad_recon_{s}", "reconciliation"),
        (f"bad_grain_{s}", "uniqueness"),
        (f"bad_contract_{s}", "schema_contract"),
    }
    for name in tables:
        step_failed = any(name in (key or "") for key in failed_steps)
        assert step_failed == name.startswith("bad_"), (name, failed_steps)
        rows = spark_session.table(f"{world.ns}.{name}").count()
        if name.startswith("bad_"):
            assert rows == 0, f"{name} was published"
            # ... though its rows were written, on the run branch the failure names.
            branches = spark_session.sql(
                f"SELECT name FROM {world.ns}.{name}.refs WHERE type = 'BRANCH' AND name <> 'main'"
            ).collect()
            assert branches, name
            branch_rows = spark_session.sql(
                f"SELECT count(*) FROM {world.ns}.{name} VERSION AS OF '{branches[0][0]}'"
            ).first()
            assert branch_rows is not None and branch_rows[0] > 0, name
        else:
            assert rows == len(winners)
