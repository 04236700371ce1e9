"""Autopilot convergence (issue 30's acceptance test): the real ``dagster-daemon`` with its
sensors alone (no run launched by the test, no ``evaluate_tick``) keeps every table equal to
an independent ground truth against hostile producers.

One daemon serves three topics for the whole module, named the way real estates name Kafka
topics (dots, hyphens, capitals: issue 48), so every sensor, run, table and CLI path here runs
on such a name; their identifiers (tables, asset keys, sensor names) are derived from it:

* ``cv.<suffix>-orders`` (identifier ``cv_<suffix>_orders``): a transactional producer
  committing every few records with aborted transactions (aborted records reuse committed
  event ids with other amounts), an outage hour (Kafka hour 03 empty on every partition)
  whose events arrive in hour 04 within the lateness, events late beyond the lateness, a
  correction that moves an event to another event hour, several events per order (the
  current state picks by event time), and two declared tables: ``_hourly`` (events and
  amount per event hour) and ``_rolling`` (``lookback_hours`` 2). Each phase is produced
  under an open transaction on every partition (aborted at the end), so no tick sees half a
  phase;
* ``cvc.<suffix>-orders``: a compacted topic from the hostile generator (skewed producers,
  aborts, re-sends, corrections, tombstones); its truth is what the log holds once the
  cleaner ran;
* ``CVR.<suffix>-orders.v1``: deleted and recreated mid-way
  (``test_recreated_topic_is_refused``).

Phases: history, converge, compare; an outage hour, late data and a moved correction,
converge, compare; a rollback of a raw run through the CLI directly followed by more late data
and a second move of the corrected event, converge, compare. The ground truth is
computed from the records the producers committed (delivery reports), never from the tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

# NewTopic and AdminClient are public but only implicitly re-exported.
from confluent_kafka import KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from backfill_assets.defs.assets import current_asset_key, raw_asset_key
from backfill_assets.defs.sensors import gap_sensor_name, late_sensor_name
from backfill_assets.demo.generator import TOPIC_CONFIGS, partition_for
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.offsets import ledger
from backfill_assets.spec.loader import load_specs, spec_path
from backfill_assets.spec.model import TopicSpec, identifier_of
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient
from backfill_assets.stack.settings import REPO_ROOT, Settings
from backfill_assets_tests.support import daemon, hostile, services

pytestmark = pytest.mark.convergence

START = datetime(2026, 8, 10, tzinfo=UTC)
HOUR = timedelta(hours=1)
PARTITIONS = 2
LOOKBACK = 2
TICK_S = 10
# Gap-sensor ticks of the main topic allowed per phase before failing. A phase needs about
# 3 sequential runs (raw, declared, late); on 2 busy cores a run can take minutes.
MAX_TICKS = 120
TXN_RECORDS = 3  # the transactional producer commits every TXN_RECORDS records

HOURLY_SQL = """
SELECT date_trunc('HOUR', event_time) AS event_hour, count(*) AS events,
       CAST(sum(amount_minor) AS BIGINT) AS amount_minor
FROM {topic}
WHERE event_time >= {{start}} AND event_time < {{end}}
GROUP BY date_trunc('HOUR', event_time)
"""
ROLLING_SQL = """
SELECT h.event_hour, count(*) AS events_3h
FROM (
  SELECT DISTINCT date_trunc('HOUR', event_time) AS event_hour
  FROM {topic}
  WHERE event_time >= {{start}} AND event_time < {{end}}
) AS h
JOIN {topic} AS o
  ON o.event_time >= h.event_hour - INTERVAL {lookback} HOURS
  AND o.event_time < h.event_hour + INTERVAL 1 HOUR
GROUP BY h.event_hour
"""


@dataclass(frozen=True)
class Ev:
    """One record to produce to the main topic: ``event_hour``/``kafka_hour`` are hours after
    START; ``minute`` places both inside their hour; ``abort``: in an aborted transaction."""

    event_id: str
    order_id: str
    event_hour: int
    kafka_hour: int
    amount: int = 1000
    minute: int = 5
    abort: bool = False


@dataclass
class Lab:
    settings: Settings
    env: dict[str, str]
    home: Path
    instance: dg.DagsterInstance
    main: TopicSpec
    compacted: TopicSpec
    recreated: TopicSpec
    specs: list[TopicSpec]
    records: list[hostile.HostileRecord] = field(default_factory=list)  # main topic
    compacted_truth: hostile.HostileTruth | None = None
    ticks_to_converge: list[tuple[str, int, float]] = field(default_factory=list)
    produced_ms: int = 0  # the last Kafka timestamp produced to the main topic

    @property
    def truth(self) -> hostile.HostileTruth:
        return hostile.HostileTruth(self.main.topic, PARTITIONS, tuple(self.records))

    def full(self, table: str) -> str:
        return f"{self.settings.catalog.name}.{self.settings.catalog.namespace}.{table}"


# --------------------------------------------------------------------------------------------
# Producers
# --------------------------------------------------------------------------------------------


def _at(hour: int, minute: int = 0) -> datetime:
    return START + timedelta(hours=hour, minutes=minute)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def _payload(ev: Ev) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": ev.event_id,
            "order_id": ev.order_id,
            "customer_id": "c-00001",
            "event_type": "created",
            "amount_minor": ev.amount,
            "currency": "EUR",
            "status": "open",
            "event_time": _ms(_at(ev.event_hour, ev.minute)),
            "channel": "web",
        }
    ).encode()


def produce(lab: Lab, events: list[Ev]) -> None:
    """Produce ``events`` in Kafka-time order with a transactional producer, TXN_RECORDS
    records per transaction at most; transactions of ``abort`` events are aborted. Meanwhile
    an open transaction on every partition holds the last stable offset (aborted at the end)."""
    topic = lab.main.topic
    first = min(_at(e.kafka_hour) for e in events)
    guards = [
        hostile.open_transaction(lab.settings, topic, p, first, transactional_id=f"{topic}.g{p}")
        for p in range(PARTITIONS)
    ]
    producer = hostile._producer(lab.settings, f"{topic}.txn", 60_000)
    ordered = sorted(events, key=lambda e: (e.kafka_hour, e.minute))
    batches: list[list[Ev]] = []
    for ev in ordered:
        if not batches or len(batches[-1]) == TXN_RECORDS or batches[-1][0].abort != ev.abort:
            batches.append([])
        batches[-1].append(ev)
    try:
        for batch in batches:
            commit = not batch[0].abort
            producer.begin_transaction()
            for ev in batch:
                lab.produced_ms = max(lab.produced_ms + 1, _ms(_at(ev.kafka_hour, 20)))
                partition = partition_for(ev.order_id, PARTITIONS)
                key, value = ev.order_id.encode(), _payload(ev)
                offset, stamp = hostile._send(
                    producer, topic, partition, key, value, lab.produced_ms, []
                )
                lab.records.append(
                    hostile.HostileRecord(
                        partition, offset, stamp, key, value, ev.event_id, 0, "event", commit
                    )
                )
            if commit:
                producer.commit_transaction(30)
            else:
                producer.abort_transaction(30)
    finally:
        producer.close()
        lab.records += [guard.abort() for guard in guards]


def _events(prefix: str, event_hour: int, kafka_hour: int, count: int, **kw: Any) -> list[Ev]:
    return [
        Ev(f"{prefix}-{i}", f"o-{prefix}-{i}", event_hour, kafka_hour, 1000 + 10 * i, **kw)
        for i in range(count)
    ]


def _create(settings: Settings, topic: str, config: dict[str, str] | None = None) -> None:
    admin = AdminClient(settings.kafka.client_config())
    new = NewTopic(
        topic,
        num_partitions=PARTITIONS,
        replication_factor=1,
        config=config or dict(TOPIC_CONFIGS),
    )
    admin.create_topics([new])[topic].result(timeout=30)


def topic_id(settings: Settings, topic: str, wait_s: float = 30) -> str:
    """The topic's id, asked of the broker directly. Right after a create, the broker's
    metadata may not know the topic yet (UNKNOWN_TOPIC_OR_PART): asked again, for up to
    ``wait_s``."""
    admin = AdminClient(settings.kafka.client_config())
    deadline = time.monotonic() + wait_s
    while True:
        futures = admin.describe_topics(TopicCollection([topic]))
        try:
            return str(futures[topic].result(timeout=30).topic_id)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# Ground truth, from the committed records only
# --------------------------------------------------------------------------------------------


def truth_raw(truth: hostile.HostileTruth) -> dict[tuple[int, int], str | None]:
    """(partition, offset) -> event id (None for a tombstone) of every committed record."""
    return {r.position: r.event_id if r.value is not None else None for r in truth.committed()}


def truth_current(truth: hostile.HostileTruth) -> dict[str, tuple[str, int, datetime]]:
    """order_id -> (event_id, amount_minor, event_time) of each order not deleted."""
    return {
        order: (row.columns["event_id"], row.columns["amount_minor"], row.columns["event_time"])
        for order, row in hostile.expected_current(truth).items()
        if not row.deleted
    }


def truth_hourly(truth: hostile.HostileTruth) -> dict[datetime, tuple[int, int]]:
    """Event hour -> (events, amount) over the winner of every event id (newest Kafka
    timestamp, then partition and offset)."""
    winners: dict[str, hostile.HostileRecord] = {}
    for r in truth.committed():
        if r.value is None or r.event_id is None:
            continue
        best = winners.get(r.event_id)
        if best is None or (r.timestamp_ms, r.partition, r.offset) > (
            best.timestamp_ms,
            best.partition,
            best.offset,
        ):
            winners[r.event_id] = r
    events: Counter[datetime] = Counter()
    amounts: Counter[datetime] = Counter()
    for r in winners.values():
        payload = json.loads(r.value or b"{}")
        hour = hostile.hour_floor(int(payload["event_time"]))
        events[hour] += 1
        amounts[hour] += int(payload["amount_minor"])
    return {h: (events[h], amounts[h]) for h in events}


def truth_rolling(truth: hostile.HostileTruth) -> dict[datetime, int]:
    """Per event hour holding events: the events of it and of the LOOKBACK hours before."""
    hourly = truth_hourly(truth)
    return {
        h: sum(hourly.get(h - i * HOUR, (0, 0))[0] for i in range(LOOKBACK + 1)) for h in hourly
    }


def _rows(lab: Lab, table: str) -> list[dict[str, Any]]:
    cat = catalog.load(lab.settings.catalog)
    name = f"{lab.settings.catalog.namespace}.{table}"
    rows: list[dict[str, Any]] = cat.load_table(name).scan().to_arrow().to_pylist()
    return rows


def tables_vs_truth(lab: Lab) -> list[str]:
    """What differs between every table and the ground truth (empty: all equal)."""
    out = _topic_vs_truth(lab, lab.main, lab.truth)
    assert lab.compacted_truth is not None
    out += _compacted_vs_truth(lab, lab.compacted_truth)
    hourly = {
        r["event_hour"].astimezone(UTC): (r["events"], r["amount_minor"])
        for r in _rows(lab, f"{lab.main.name}_hourly")
    }
    rolling = {
        r["event_hour"].astimezone(UTC): r["events_3h"]
        for r in _rows(lab, f"{lab.main.name}_rolling")
    }
    for name, got_t, want_t in (
        ("hourly", hourly, truth_hourly(lab.truth)),
        ("rolling", rolling, truth_rolling(lab.truth)),
    ):
        if got_t != want_t:
            out.append(_diff(f"{lab.main.name}_{name}", got_t, want_t))
    return out


def _raw_and_current(
    lab: Lab, spec: TopicSpec
) -> tuple[dict[tuple[int, int], str | None], dict[str, tuple[str, int, datetime]]]:
    raw = {
        (r["kafka_partition"], r["kafka_offset"]): r["event_id"] for r in _rows(lab, spec.raw_table)
    }
    current = {
        r["order_id"]: (r["event_id"], r["amount_minor"], r["event_time"].astimezone(UTC))
        for r in _rows(lab, spec.current_table)
    }
    return raw, current


def _topic_vs_truth(lab: Lab, spec: TopicSpec, truth: hostile.HostileTruth) -> list[str]:
    raw, current = _raw_and_current(lab, spec)
    out = []
    for name, got, want in (
        (spec.raw_table, raw, truth_raw(truth)),
        (spec.current_table, current, truth_current(truth)),
    ):
        if got != want:
            out.append(_diff(name, got, want))
    return out


def _compacted_vs_truth(lab: Lab, produced: hostile.HostileTruth) -> list[str]:
    """The log cleaner may remove more records between any read of the log and the run's own
    read, so the compacted raw table is pinned between two bounds: every row is a committed
    record as produced (same partition, offset and event id), and every record Kafka still
    holds now is a row. Compaction keeps each key's newest record, so the current-state table
    equals the newest version per key of what was produced."""
    raw, current = _raw_and_current(lab, lab.compacted)
    out = []
    produced_raw = truth_raw(produced)
    foreign = {k: v for k, v in raw.items() if produced_raw.get(k, "<absent>") != v}
    if foreign:
        out.append(
            f"{lab.compacted.raw_table}: rows not produced so: {sorted(foreign.items())[:8]}"
        )
    still = truth_raw(hostile.truth_from_log(lab.settings, lab.compacted.topic))
    unread = {k: v for k, v in still.items() if raw.get(k, "<absent>") != v}
    if unread:
        out.append(
            f"{lab.compacted.raw_table}: records Kafka holds, not in raw: "
            f"{sorted(unread.items())[:8]}"
        )
    want = truth_current(produced)
    if current != want:
        out.append(_diff(lab.compacted.current_table, current, want))
    return out


def _diff(name: str, got: dict[Any, Any], want: dict[Any, Any]) -> str:
    missing = {k: v for k, v in want.items() if k not in got}
    extra = {k: v for k, v in got.items() if k not in want}
    wrong = {k: (got[k], v) for k, v in want.items() if k in got and got[k] != v}
    return (
        f"{name}: {len(got)} rows, truth {len(want)}; missing {sorted(missing.items())[:8]}; "
        f"extra {sorted(extra.items())[:8]}; differing (got, truth) {sorted(wrong.items())[:8]}"
    )


# --------------------------------------------------------------------------------------------
# The daemon and convergence
# --------------------------------------------------------------------------------------------


def _spec_entry(base: dict[str, Any], topic: str, start: datetime, tables: bool) -> dict[str, Any]:
    """``topic``'s entry, with no ``name``: its identifier is derived (identifier_of), and
    its declared tables' names and SQL use that identifier."""
    entry = {**base, "topic": topic, "partition_start": start.isoformat(), "tables": []}
    ident = identifier_of(topic)
    if tables:
        entry["tables"] = [
            {
                "name": f"{ident}_hourly",
                "sql": HOURLY_SQL.format(topic=ident),
                "event_time": "event_hour",
                "grain": ["event_hour"],
                "columns": [
                    {"name": "event_hour", "type": "timestamp", "nullable": False},
                    {"name": "events", "type": "bigint", "nullable": False},
                    {"name": "amount_minor", "type": "bigint", "nullable": False},
                ],
                "measures": [{"name": "events", "table": "sum(events)", "source": "count(*)"}],
            },
            {
                "name": f"{ident}_rolling",
                "sql": ROLLING_SQL.format(topic=ident, lookback=LOOKBACK),
                "event_time": "event_hour",
                "grain": ["event_hour"],
                "lookback_hours": LOOKBACK,
                "columns": [
                    {"name": "event_hour", "type": "timestamp", "nullable": False},
                    {"name": "events_3h", "type": "bigint", "nullable": False},
                ],
            },
        ]
    return entry


def _write_specs(directory: Path, suffix: str) -> Path:
    doc = yaml.safe_load(spec_path().read_text())
    (base,) = [t for t in doc["topics"] if t["topic"] == "orders"]
    # The hostile producers' clocks run up to 40 s early: their first records are stamped in
    # the hour before START.
    entries = [
        _spec_entry(base, f"cv.{suffix}-orders", START, tables=True),
        _spec_entry(base, f"cvc.{suffix}-orders", START - HOUR, tables=False),
        _spec_entry(base, f"CVR.{suffix}-orders.v1", START, tables=False),
    ]
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "topics.yaml"
    path.write_text(yaml.safe_dump({"topics": entries}, sort_keys=False))
    return path


def _compacted(settings: Settings, topic: str) -> hostile.HostileTruth:
    """Produce the compacted topic and wait until the log cleaner removed records and the
    log is stable; return what was produced (the tests bound the raw table by it and by what
    Kafka still holds, see :func:`_compacted_vs_truth`)."""
    config = hostile.HostileConfig(
        start=START,
        topic=topic,
        partitions=PARTITIONS,
        hours=2,
        events_per_hour=15,
        seed=11,
        compacted=True,
    )
    produced = hostile.generate(settings, config)
    deadline = time.monotonic() + 120
    previous: hostile.HostileTruth | None = None
    while time.monotonic() < deadline:
        survived = hostile.truth_from_log(settings, topic)
        if len(survived.records) < len(produced.committed()) and previous == survived:
            return produced
        previous = survived
        time.sleep(10)
    raise AssertionError(f"the log cleaner did not compact {topic} within 120 s")


@pytest.fixture(scope="module")
def lab(
    stack_settings: Settings, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    suffix = uuid.uuid4().hex[:8]
    home = tmp_path_factory.mktemp("convergence")
    path = _write_specs(home / "spec", suffix)
    specs = load_specs(path)
    main, compacted, recreated = specs
    # Kafka by the real name; everything else by three distinct derived identifiers.
    assert [s.name for s in specs] == [
        f"cv_{suffix}_orders",
        f"cvc_{suffix}_orders",
        f"cvr_{suffix}_orders_v1",
    ]
    _create(stack_settings, main.topic)
    _create(stack_settings, recreated.topic)
    compacted_truth = _compacted(stack_settings, compacted.topic)
    env = {
        **os.environ,
        **stack_env,
        "BACKFILL_SPEC": str(path),
        "BACKFILL_SENSORS": "on",
        "BACKFILL_SENSOR_INTERVAL_S": str(TICK_S),
        "BACKFILL_MAINTENANCE_SCHEDULES": "off",
        "BACKFILL_DAGSTER_STORAGE": str(home / "storage"),
        "DAGSTER_HOME": str(home / "dagster"),
    }
    with pytest.MonkeyPatch.context() as mp:
        # The instance this process opens (dagster.yaml reads the storage from the environment)
        # is the daemon's.
        mp.setenv("BACKFILL_DAGSTER_STORAGE", env["BACKFILL_DAGSTER_STORAGE"])
        mp.setenv("BACKFILL_SPEC", str(path))
        with (
            services.dagster_services(home / "dagster", env),
            dg.DagsterInstance.from_config(str(home / "dagster")) as instance,
        ):
            yield Lab(
                stack_settings,
                env,
                home,
                instance,
                main,
                compacted,
                recreated,
                specs,
                compacted_truth=compacted_truth,
            )


def sensor_ticks(lab: Lab, name: str, after: float) -> list[Any]:
    return daemon.sensor_ticks(lab.instance, name, after)


def _tick_summary(lab: Lab, after: float) -> str:
    sensors = [
        name for spec in lab.specs for name in (gap_sensor_name(spec), late_sensor_name(spec))
    ]
    return daemon.tick_summary(lab.instance, sensors, after)


def _due(lab: Lab) -> dict[str, Any]:
    """What the gap and late-data checks still find, per topic (empty: nothing due)."""
    cat = catalog.load(lab.settings.catalog)
    ns = lab.settings.catalog.namespace
    out: dict[str, Any] = {}
    for spec in (lab.main, lab.compacted):
        found = detect.find(KafkaClient(lab.settings), cat, ns, spec, specs=lab.specs)
        late = detect.late_event_hours(cat, ns, spec)
        due = {
            "raw": found.raw_gaps,
            "current": found.current_gaps,
            **{t: sorted(h) for t, h in found.tables_due.items() if h},
            **{f"late {t}": sorted(h) for t, h in late.items() if h},
        }
        out.update({f"{spec.topic} {k}": v for k, v in due.items() if v})
    return out


def converge(lab: Lab, phase: str) -> None:
    """Wait, with the daemon doing every launch, until no run is active, nothing is due and
    every table equals the truth; fail after MAX_TICKS gap-sensor ticks of the main topic with
    what is missing and the last ticks' skip reasons and errors."""
    began = time.time()
    gap = gap_sensor_name(lab.main)
    differs: list[str] = []
    due: dict[str, Any] = {}
    settled_but_wrong = 0  # polls in a row with nothing due, nothing running, tables wrong
    while True:
        ticks = len(sensor_ticks(lab, gap, began))
        failed = daemon.failures(lab.instance, began)
        assert not failed, f"{phase}: a sensor-launched run failed:\n" + "\n".join(failed)
        active = daemon.sensor_runs(lab.instance, daemon.ACTIVE)
        if not active:
            due = _due(lab)
            if not due:
                differs = tables_vs_truth(lab)
                if not differs:
                    lab.ticks_to_converge.append((phase, ticks, time.time() - began))
                    return
                settled_but_wrong += 1
                # Nothing is due, so the sensors will request nothing more: final.
                assert settled_but_wrong < 10, f"{phase}: settled, but tables differ: {differs}"
            else:
                settled_but_wrong = 0
        else:
            settled_but_wrong = 0
        if ticks > MAX_TICKS:
            raise AssertionError(
                f"{phase}: not converged after {ticks} ticks of {gap} "
                f"({time.time() - began:.0f} s); active runs {[r.run_id for r in active]}; "
                f"still due {due}; tables vs truth {differs}\nlast ticks:\n"
                + _tick_summary(lab, began)
            )
        time.sleep(3)


def cli(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "backfill_assets.ops.cli", *args],
        cwd=REPO_ROOT,
        env=lab.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_sensors_alone_converge_every_table(lab: Lab) -> None:
    began = time.monotonic()
    # (1) History. Aborted transactions reuse committed event ids with other amounts; order
    # o-a-0 gets a later event (the current state follows event time).
    produce(
        lab,
        [
            *_events("a", 0, 0, 5),
            *_events("x", 0, 0, 3, abort=True, minute=30),
            *_events("b", 1, 1, 3),
            Ev("a-1", "o-a-1", 0, 1, amount=999_999, abort=True, minute=30),
            Ev("a-1b", "o-a-1", 0, 1, amount=1, abort=True, minute=31),
            *_events("c", 2, 2, 4, minute=40),
            Ev("a-0-next", "o-a-0", 2, 2, amount=4242, minute=50),
        ],
    )
    converge(lab, "history")

    # (2) Kafka hour 03 is an outage (empty on every partition): its events (event hour 03)
    # arrive in hour 04, within the 3 h lateness. A correction in Kafka hour 05 moves event
    # a-2 from event hour 00 to 05; events of event hour 01 arrive in Kafka hour 06, beyond
    # the lateness.
    produce(
        lab,
        [
            *_events("d", 3, 4, 3),
            *_events("e", 4, 4, 2, minute=30),
            Ev("a-2", "o-a-2", 5, 5, amount=7777, minute=15),
            *_events("f", 5, 5, 2, minute=30),
            *_events("late1", 1, 6, 2),
            *_events("g", 6, 6, 1, minute=40),
        ],
    )
    converge(lab, "outage, late and moved")

    # (3) A rollback in the middle, as an operator does it: the raw run that published Kafka
    # hour 05 (the correction) is undone through the CLI. (4) Right after it, the moved event
    # moves again (event hour 05 -> 02) and more events arrive late, within and beyond the
    # lateness. The sensors rebuild raw, current and both declared tables.
    cat = catalog.load(lab.settings.catalog)
    ns = lab.settings.catalog.namespace
    undone = ledger.coverage(cat, ns, lab.full(lab.main.raw_table))[_at(5)].run_id
    out = cli(lab, "rollback", "--run", undone, "--table", lab.main.raw_table, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    done = json.loads(out.stdout)
    # Recorded in the daemon's instance under the identifier's asset key (table -> asset).
    assert [t["table_name"] for t in done["tables"]] == [lab.full(lab.main.raw_table)], done
    assert (
        done["dagster"]["recorded"]
        and done["dagster"]["materializations"] + done["dagster"]["observations"] > 0
    ), done["dagster"]
    assert _at(5) not in ledger.coverage(cat, ns, lab.full(lab.main.raw_table))
    produce(
        lab,
        [
            Ev("a-2", "o-a-2", 2, 7, amount=8888),
            *_events("late2", 6, 7, 2, minute=10),
            *_events("late3", 3, 8, 1),
            *_events("i", 8, 8, 2, minute=30),
        ],
    )
    converge(lab, "rollback, then late and moved again")
    wall = time.monotonic() - began
    # The operator's view by the real Kafka name agrees: nothing due.
    out = cli(lab, "gaps", "--topic", lab.main.topic, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["topic"] == lab.main.topic
    # Shown with -s (and kept in the test's Dagster home): ticks and seconds per phase.
    summary = f"convergence: {lab.ticks_to_converge}; phases took {wall:.0f} s\n"
    sys.stderr.write(summary)
    (lab.home / "convergence.txt").write_text(summary)
    assert not tables_vs_truth(lab)


def test_recreated_topic_is_refused(lab: Lab) -> None:
    """A topic deleted and recreated under the same name: its gap sensor requests no run and
    says why (topic, both topic ids, the adopt command) on every tick; its raw table is left
    as it was; the other topics still converge."""
    topic = lab.recreated.topic
    # Its first life: one hour, published by the sensors.
    old_records = [Ev(f"r-{i}", f"o-r-{i}", 0, 0) for i in range(3)]
    _produce_plain(lab.settings, topic, old_records)
    converge_raw(lab, lab.recreated, 1)
    cat = catalog.load(lab.settings.catalog)
    table = cat.load_table(f"{lab.settings.catalog.namespace}.{lab.recreated.raw_table}")
    snapshot = table.current_snapshot()
    old_id = topic_id(lab.settings, topic)

    admin = AdminClient(lab.settings.kafka.client_config())
    admin.delete_topics([topic])[topic].result(timeout=30)
    deadline = time.monotonic() + 60
    while True:
        try:
            _create(lab.settings, topic)
            break
        except Exception:  # still being deleted
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    new_id = topic_id(lab.settings, topic)
    assert new_id != old_id
    _produce_plain(lab.settings, topic, [Ev(f"n-{i}", f"o-n-{i}", 1, 1) for i in range(4)])

    since = time.time()
    gap = gap_sensor_name(lab.recreated)
    # The daemon evaluates its sensors one after another: on busy cores a sensor ticks far
    # less often than every TICK_S (the first run of this tier saw gaps of minutes).
    deadline = time.monotonic() + 60 * TICK_S
    # Two refusing ticks show it is said on every tick, not once (a third proves no more).
    while len(sensor_ticks(lab, gap, since)) < 2 and time.monotonic() < deadline:
        time.sleep(2)
    ticks = sensor_ticks(lab, gap, since)
    assert len(ticks) >= 2, _tick_summary(lab, since)
    keys = {raw_asset_key(lab.recreated), current_asset_key(lab.recreated)}
    launched = [
        r
        for r in lab.instance.get_runs(filters=dg.RunsFilter(created_after=_naive(since)))
        if keys & set(r.asset_selection or ())
    ]
    assert not launched, f"runs launched for the recreated topic: {[r.run_id for r in launched]}"
    for tick in ticks:
        said = f"{tick.skip_reason or ''} {tick.error.message if tick.error else ''}"
        for part in (
            f"topic '{topic}'",
            f"old topic id {old_id}",
            f"new topic id {new_id}",
            f"backfill-assets adopt --topic {topic}",
        ):
            assert part in said, f"tick {tick.tick_id} does not say {part!r}: {said!r}"
    table = cat.load_table(f"{lab.settings.catalog.namespace}.{lab.recreated.raw_table}")
    assert table.current_snapshot() == snapshot
    # The other topics still converge.
    produce(lab, [*_events("j", 10, 10, 2)])
    converge(lab, "beside a recreated topic")


def _naive(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _produce_plain(settings: Settings, topic: str, events: list[Ev]) -> None:
    producer = hostile._producer(settings, f"{topic}.{uuid.uuid4().hex[:6]}", 60_000)
    producer.begin_transaction()
    for ev in events:
        hostile._send(
            producer,
            topic,
            partition_for(ev.order_id, PARTITIONS),
            ev.order_id.encode(),
            _payload(ev),
            _ms(_at(ev.kafka_hour, 20)),
            [],
        )
    producer.commit_transaction(30)
    producer.close()


def converge_raw(lab: Lab, spec: TopicSpec, hours: int) -> None:
    """Wait until the sensors published ``hours`` Kafka hours of ``spec``'s raw table."""
    cat = catalog.load(lab.settings.catalog)
    deadline = time.monotonic() + MAX_TICKS * TICK_S
    while time.monotonic() < deadline:
        try:
            entries = ledger.coverage(cat, lab.settings.catalog.namespace, lab.full(spec.raw_table))
        except Exception:  # no table yet
            entries = {}
        if len(entries) >= hours and not daemon.sensor_runs(lab.instance, daemon.ACTIVE):
            return
        time.sleep(3)
    raise AssertionError(f"{spec.raw_table} not published within {MAX_TICKS} ticks")
