"""Tests for the hostile-producer generator: the pure truth rules on hand-made records first,
then a real broker (skewed transactional producers, aborts, re-sends, corrections, tombstones,
a partition added mid-history, an open transaction, a compacted topic)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import Consumer, IsolationLevel, KafkaError, TopicPartition

# OffsetSpec is public but only implicitly re-exported.
from confluent_kafka.admin import AdminClient, NewTopic, OffsetSpec  # type: ignore[attr-defined]

from backfill_assets.demo.generator import TOPIC_CONFIGS, partition_for
from backfill_assets.errors import GeneratorError
from backfill_assets.lake.offsets.windows import record_hash as windows_record_hash
from backfill_assets.spec.loader import load_specs
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.hostile import (
    CurrentRow,
    HostileConfig,
    HostileRecord,
    HostileTruth,
    HourFigures,
    HourlyFigures,
    add_partitions,
    conflicts,
    create_topic,
    events,
    expected_current,
    expected_hourly,
    generate,
    hour_figures,
    hour_floor,
    hour_of,
    merge,
    normalise_windows,
    open_transaction,
    plan_hostile,
    produce,
    record_hash,
    truth_from_log,
    windows,
)

START = datetime(2026, 1, 1, tzinfo=UTC)
# record_hash(0, 5, b"k", b"v") as Spark computes it: SELECT xxhash64(0, 5L, X'6B', X'76',
# false, false) (the Spark side of the checksum check, lake/write/replay.py::record_hash_expr)
HASH_K_V = 508117354465523008


def at(hour: int, minute: int = 0, second: int = 0) -> datetime:
    """2026-01-01 hh:mm:ss UTC."""
    return START.replace(hour=hour, minute=minute, second=second)


def ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


# --------------------------------------------------------------------------------------------
# Pure rules on hand-made records
# --------------------------------------------------------------------------------------------


def rec(
    partition: int,
    offset: int,
    stamp: datetime | int,
    *,
    value: bytes | None = b"{}",
    key: bytes = b"k",
    event_id: str | None = None,
    kind: str = "event",
    committed: bool = True,
) -> HostileRecord:
    return HostileRecord(
        partition=partition,
        offset=offset,
        timestamp_ms=stamp if isinstance(stamp, int) else ms(stamp),
        key=key,
        value=value,
        event_id=event_id,
        producer=0,
        kind=kind,  # type: ignore[arg-type]
        committed=committed,
    )


def skewed_truth() -> HostileTruth:
    """p0: a record stamped 10:59:40 after one stamped 11:00:05, an aborted record and a marker
    gap; p1: a record before the first hour, and an hour without records."""
    return HostileTruth(
        topic="t",
        partitions=2,
        records=(
            rec(0, 0, at(10, 59, 0)),
            rec(0, 1, at(11, 0, 5)),
            rec(0, 2, at(10, 59, 40)),
            # offset 3: a commit marker
            rec(0, 4, at(10, 59, 50), committed=False),
            rec(0, 5, at(12, 0, 10)),
            rec(0, 6, at(11, 59, 59)),
            rec(1, 0, at(9, 59, 59)),
            rec(1, 1, at(10, 30)),
            rec(1, 2, at(12, 30)),
        ),
    )


HOURS = [at(10), at(11), at(12)]


def test_windows_offsets_own_the_hours() -> None:
    truth = skewed_truth()
    assert windows(truth, HOURS) == {
        at(10): {0: (0, 1), 1: (1, 2)},
        at(11): {0: (1, 5), 1: (2, 2)},
        at(12): {0: (5, 7), 1: (2, 3)},
    }
    # 10:59:40 (after 11:00:05) is hour 11, 11:59:59 (after 12:00:10) is hour 12; the aborted
    # record and the record before the first boundary belong to no hour.
    assert hour_of(truth, HOURS) == {
        (0, 0): at(10),
        (0, 1): at(11),
        (0, 2): at(11),
        (0, 5): at(12),
        (0, 6): at(12),
        (1, 1): at(10),
        (1, 2): at(12),
    }
    assert normalise_windows(truth, windows(truth, HOURS)) == {
        at(10): frozenset({(0, 0), (1, 1)}),
        at(11): frozenset({(0, 1), (0, 2)}),
        at(12): frozenset({(0, 5), (0, 6), (1, 2)}),
    }


def test_windows_joined_partition_and_chain_continuation() -> None:
    truth = skewed_truth()
    # p1 was created at 11:00: its chain starts at offset 0 in hour 11, whatever the stamps.
    assert windows(truth, HOURS, joined_at={1: at(11)}) == {
        at(10): {0: (0, 1)},
        at(11): {0: (1, 5), 1: (0, 2)},
        at(12): {0: (5, 7), 1: (2, 3)},
    }
    assert hour_of(truth, HOURS, joined_at={1: at(11)})[(1, 0)] == at(11)
    # A partition joining after the last hour is absent.
    assert windows(truth, HOURS[:1], joined_at={1: at(11)}) == {at(10): {0: (0, 1)}}
    # Continuing a chain from given offsets (e.g. an hour sealed at the last stable offset 3,
    # just past the marker) instead of searching for the first hour's start.
    assert windows(truth, HOURS[1:], start_offsets={0: 3}) == {
        at(11): {0: (3, 5), 1: (2, 2)},
        at(12): {0: (5, 7), 1: (2, 3)},
    }
    # Boundaries that differ only by marker/aborted offsets attribute identically.
    kafka_like = {at(10): {0: (0, 1)}, at(11): {0: (1, 5)}, at(12): {0: (5, 9)}}
    truth_like = {at(10): {0: (0, 1)}, at(11): {0: (1, 4)}, at(12): {0: (4, 7)}}
    assert normalise_windows(truth, kafka_like) == normalise_windows(truth, truth_like)


def test_windows_reject_bad_hours() -> None:
    truth = skewed_truth()
    with pytest.raises(GeneratorError, match="consecutive"):
        windows(truth, [at(10), at(12)])
    with pytest.raises(GeneratorError, match="whole hour"):
        windows(truth, [at(10, 30)])
    with pytest.raises(GeneratorError, match="timezone-aware"):
        windows(truth, [datetime(2026, 1, 1, 10)])


def test_hour_figures_and_record_hash() -> None:
    assert record_hash(0, 5, b"k", b"v") == HASH_K_V
    assert record_hash(0, 5, b"k", b"v") == windows_record_hash(0, 5, b"k", b"v")
    # NULL and empty differ, and so do a key and a value with the same bytes.
    assert record_hash(0, 5, b"k", None) != record_hash(0, 5, b"k", b"")
    assert record_hash(3, 9, None, b"v") != record_hash(3, 9, b"v", None)
    truth = skewed_truth()
    figures = hour_figures(truth, HOURS)
    assert figures[at(11)] == HourFigures(
        records=2, bytes=6, checksum=record_hash(0, 1, b"k", b"{}") + record_hash(0, 2, b"k", b"{}")
    )
    assert figures[at(10)].records == 2
    assert figures[at(12)].records == 3


def payload(
    event_id: str,
    order_id: str,
    event_time: datetime,
    *,
    amount_minor: int = 1000,
    currency: str = "EUR",
    event_type: str = "created",
    status: str = "open",
) -> bytes:
    return json.dumps(
        {
            "schema_version": 2,
            "event_id": event_id,
            "order_id": order_id,
            "customer_id": "c-00001",
            "event_type": event_type,
            "status": status,
            "amount_minor": amount_minor,
            "currency": currency,
            "channel": "web",
            "event_time": ms(event_time),
        },
        separators=(",", ":"),
        sort_keys=True,
    ).encode()


def events_truth() -> HostileTruth:
    a = payload("e1", "o1", at(10, 0), amount_minor=100)
    b1 = payload("e2", "o1", at(10, 5), amount_minor=200, event_type="updated")
    b2 = payload("e2", "o1", at(10, 5), amount_minor=250, event_type="updated", status="paid")
    b3 = payload("e2", "o1", at(10, 5), amount_minor=999, event_type="updated")
    c1 = payload("e3", "o2", at(10, 59, 59), amount_minor=300, currency="USD")
    c2 = payload("e3", "o2", at(10, 59, 59), amount_minor=350, currency="USD")
    d = payload("e4", "o3", at(11, 10), amount_minor=400, event_type="cancelled")
    ghost = payload("e5", "o3", at(11, 20), amount_minor=500)
    return HostileTruth(
        topic="t",
        partitions=3,
        records=(
            rec(0, 0, at(10, 0, 30), key=b"o1", value=a, event_id="e1"),
            # an identical re-send with a smaller timestamp: collapses, the original wins
            rec(1, 3, at(10, 0, 20), key=b"o1", value=a, event_id="e1", kind="resend"),
            rec(0, 1, at(10, 5, 40), key=b"o1", value=b1, event_id="e2"),
            # a correction stamped earlier (skewed clock) at a later offset: the log's order
            # wins, the correction replaces the original
            rec(0, 2, at(10, 5, 10), key=b"o1", value=b2, event_id="e2", kind="correction"),
            # an aborted correction never counts
            rec(0, 3, at(10, 9), key=b"o1", value=b3, event_id="e2", committed=False),
            # a tombstone stamped before e2's event_time: e2 stays current
            rec(0, 4, at(10, 4), key=b"o1", value=None, kind="tombstone"),
            rec(1, 0, at(11, 0, 1), key=b"o2", value=c1, event_id="e3"),
            # a correction with the same timestamp in a higher partition wins the tie
            rec(2, 0, at(11, 0, 1), key=b"o2", value=c2, event_id="e3", kind="correction"),
            # tombstone later than e3's event time: o2 is deleted
            rec(1, 1, at(11, 0, 2), key=b"o2", value=None, kind="tombstone"),
            rec(2, 1, at(11, 10, 30), key=b"o3", value=d, event_id="e4"),
            # an aborted event and an aborted tombstone exist nowhere
            rec(2, 2, at(11, 20, 30), key=b"o3", value=ghost, event_id="e5", committed=False),
            rec(2, 3, at(11, 30), key=b"o3", value=None, kind="tombstone", committed=False),
        ),
    )


def test_events_conflicts_and_winners() -> None:
    truth = events_truth()
    winners = events(truth)
    assert {eid: r.position for eid, r in winners.items()} == {
        "e1": (0, 0),
        "e2": (0, 2),
        "e3": (2, 0),
        "e4": (2, 1),
    }
    assert conflicts(truth) == {"e2": 2, "e3": 2}


def test_expected_hourly_and_current() -> None:
    truth = events_truth()
    assert expected_hourly(truth) == {
        (at(10), "EUR"): HourlyFigures(events=2, orders=1, amount_minor=350, cancelled=0),
        (at(10), "USD"): HourlyFigures(events=1, orders=1, amount_minor=350, cancelled=0),
        (at(11), "EUR"): HourlyFigures(events=1, orders=1, amount_minor=400, cancelled=1),
    }
    current = expected_current(truth)
    assert set(current) == {"o1", "o2", "o3"}
    o1 = current["o1"]
    assert (o1.deleted, o1.record.position) == (False, (0, 2))
    assert o1.columns == {
        "event_id": "e2",
        "order_id": "o1",
        "customer_id": "c-00001",
        "event_type": "updated",
        "status": "paid",
        "amount_minor": 250,
        "currency": "EUR",
        "channel": "web",
        "event_time": at(10, 5),
    }
    assert current["o2"] == CurrentRow(
        order_id="o2", deleted=True, record=truth.by_position()[(1, 1)], columns={}
    )
    assert (current["o3"].deleted, current["o3"].columns["amount_minor"]) == (False, 400)


def test_current_tie_on_time_goes_to_the_later_offset_then_the_later_timestamp() -> None:
    event = payload("e1", "o1", at(10, 0))

    def tie(tombstone_partition: int) -> bool:
        truth = HostileTruth(
            topic="t",
            partitions=2,
            records=(
                rec(0, 0, at(10, 0, 1), key=b"o1", value=event, event_id="e1"),
                rec(tombstone_partition, 1, at(10, 0), key=b"o1", value=None, kind="tombstone"),
            ),
        )
        return expected_current(truth)["o1"].deleted

    # event_time 10:00 == tombstone stamp 10:00. In one partition the later offset (the
    # tombstone) wins, though its Kafka stamp is earlier; across partitions, the later Kafka
    # stamp (the event's 10:00:01) wins.
    assert tie(tombstone_partition=0) is True
    assert tie(tombstone_partition=1) is False


def test_nothing_depends_on_the_local_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    def figures() -> tuple[Any, ...]:
        truth = events_truth()
        return (
            windows(skewed_truth(), HOURS),
            expected_hourly(truth),
            expected_current(truth),
            hour_floor(ms(at(10, 59, 59))),
        )

    utc = figures()
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert figures() == utc
        assert utc[3] == at(10)
    finally:
        monkeypatch.undo()
        time.tzset()


def test_plan_is_deterministic_and_within_the_contract() -> None:
    config = HostileConfig(start=START, topic="hostile-plan", seed=3)
    plan = plan_hostile(config)
    assert plan == plan_hostile(config)
    assert [p.value for p in plan] != [
        p.value for p in plan_hostile(HostileConfig(start=START, topic="hostile-plan", seed=4))
    ]
    kinds = {p.kind for p in plan}
    assert kinds == {"event", "resend", "correction", "tombstone"}
    (orders,) = [s for s in load_specs() if s.topic == "orders"]
    for p in plan:
        assert p.key == p.order_id.encode()
        if p.value is None:
            continue
        data = json.loads(p.value)
        assert data["schema_version"] == 2
        assert set(data) == {c.name for c in orders.columns} | {"schema_version"}
        for column in orders.columns:
            if column.allowed is not None:
                assert data[column.name] in column.allowed, (column.name, data)
            if column.min is not None and column.max is not None:
                assert column.min <= data[column.name] <= column.max
    # Transactions: one producer, one true-time hour, exactly one end each; some aborted.
    by_txn: dict[int, list[Any]] = defaultdict(list)
    for p in plan:
        by_txn[p.transaction].append(p)
    for txn in by_txn.values():
        assert len({(p.producer, p.hour_index(config), p.commit) for p in txn}) == 1
        assert [p.ends_transaction for p in txn] == [False] * (len(txn) - 1) + [True]
        assert len(txn) <= config.max_transaction_records
    assert any(not txn[0].commit for txn in by_txn.values())
    # Kafka timestamps are the true time plus the producer's skew.
    assert {p.timestamp_ms(config) - p.true_ms for p in plan} == {-40_000, 0, 35_000}


def test_config_is_validated() -> None:
    with pytest.raises(GeneratorError, match="abort_share"):
        HostileConfig(start=START, abort_share=1.5)
    with pytest.raises(GeneratorError, match="whole hour"):
        HostileConfig(start=at(1, 30))
    with pytest.raises(GeneratorError, match="producer_skews_ms"):
        HostileConfig(start=START, producer_skews_ms=())


# --------------------------------------------------------------------------------------------
# Against the real broker
# --------------------------------------------------------------------------------------------


def read_topic(
    settings: Settings, topic: str, level: str
) -> dict[tuple[int, int], tuple[int, bytes | None, bytes | None]]:
    """Every record of ``topic`` at ``level``, assigned from offset 0 (no group is joined)."""
    conf: dict[str, Any] = {
        **settings.kafka.client_config(),
        "group.id": f"test-hostile-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": level,
        "enable.partition.eof": True,
    }
    admin = AdminClient(dict(settings.kafka.client_config()))
    partitions = sorted(admin.list_topics(topic=topic, timeout=30).topics[topic].partitions)
    consumer = Consumer(conf)
    out: dict[tuple[int, int], tuple[int, bytes | None, bytes | None]] = {}
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        done: set[int] = set()
        deadline = time.monotonic() + 60
        while len(done) < len(partitions):
            assert time.monotonic() < deadline, f"did not reach the end of {topic}"
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                done.add(int(msg.partition() or 0))
                continue
            out[(int(msg.partition() or 0), int(msg.offset() or 0))] = (
                msg.timestamp()[1],
                msg.key(),
                msg.value(),
            )
    finally:
        consumer.close()
    return out


def log_ends(settings: Settings, topic: str, partition: int) -> tuple[int, int]:
    """(last stable offset, high watermark) of one partition."""
    admin = AdminClient(dict(settings.kafka.client_config()))
    out = []
    for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED):
        # Keep the returned dict alive until result(): a future popped out of a dropped dict
        # is never resolved (confluent-kafka 2.16).
        futures = admin.list_offsets(
            {TopicPartition(topic, partition): OffsetSpec.latest()},  # type: ignore[no-untyped-call]
            isolation_level=level,
            request_timeout=30,
        )
        out.append(int(next(iter(futures.values())).result().offset))
    return out[0], out[1]


def wait_stable(settings: Settings, topic: str, partition: int) -> tuple[int, int]:
    """Wait until no transaction is open (markers are written after commit returns)."""
    deadline = time.monotonic() + 30
    while True:
        lso, hw = log_ends(settings, topic, partition)
        if lso == hw or time.monotonic() > deadline:
            return lso, hw
        time.sleep(0.05)


@dataclass(frozen=True)
class Phased:
    config: HostileConfig
    first: HostileTruth
    second: HostileTruth
    full: HostileTruth
    hours: list[datetime]  # the configured hours plus one for the +35 s spill
    joined: dict[int, datetime]


@pytest.fixture(scope="module")
def compacted_run(stack_settings: Settings) -> tuple[HostileConfig, HostileTruth]:
    """A compacted topic, produced first so the log cleaner (15 s back-off) runs meanwhile."""
    config = HostileConfig(
        start=START,
        topic=f"hostile-compacted-{uuid.uuid4().hex[:8]}",
        partitions=2,
        hours=3,
        events_per_hour=25,
        seed=5,
        compacted=True,
    )
    return config, generate(stack_settings, config)


@pytest.fixture(scope="module")
def phased(stack_settings: Settings, compacted_run: Any) -> Iterator[Phased]:
    """Hours 0-3 into 3 partitions, then 2 partitions added, then hours 4-7 into 5."""
    config = HostileConfig(start=START, topic=f"hostile-{uuid.uuid4().hex[:8]}", seed=4)
    first = produce(stack_settings, config, 0, 3)
    assert add_partitions(stack_settings, config.topic, 5) == 5
    second = produce(stack_settings, config, 4, 7)
    hours = [START + timedelta(hours=h) for h in range(config.hours + 1)]
    yield Phased(
        config=config,
        first=first,
        second=second,
        full=merge(first, second),
        hours=hours,
        joined={3: hours[4], 4: hours[4]},
    )


def test_produced_in_plan_order_with_the_planned_bytes(phased: Phased) -> None:
    config = phased.config
    plan = plan_hostile(config)
    early = [p for p in plan if p.hour_index(config) <= 3]
    late = [p for p in plan if p.hour_index(config) >= 4]
    for planned, truth, partitions in ((early, phased.first, 3), (late, phased.second, 5)):
        assert truth.partitions == partitions
        assert [(p.key, p.value, p.timestamp_ms(config), p.kind) for p in planned] == [
            (r.key, r.value, r.timestamp_ms, r.kind) for r in truth.records
        ]
        assert all(
            r.partition == partition_for(p.order_id, partitions)
            for p, r in zip(planned, truth.records, strict=True)
        )
        # offsets grow in produce order within a partition
        last: dict[int, int] = {}
        for r in truth.records:
            assert r.offset > last.get(r.partition, -1)
            last[r.partition] = r.offset


def test_committed_reader_sees_exactly_the_committed_truth(
    stack_settings: Settings, phased: Phased
) -> None:
    full = phased.full
    committed = read_topic(stack_settings, full.topic, "read_committed")
    assert committed == {r.position: (r.timestamp_ms, r.key, r.value) for r in full.committed()}
    aborted = full.aborted()
    assert len(aborted) > 10
    assert not {r.position for r in aborted} & set(committed)
    # The aborted records do occupy their offsets (an uncommitted reader sees them there);
    # every other offset is a transaction marker.
    everything = read_topic(stack_settings, full.topic, "read_uncommitted")
    assert everything == {r.position: (r.timestamp_ms, r.key, r.value) for r in full.records}
    # Each transaction wrote one marker into every partition it touched.
    config = phased.config
    touched: dict[int, set[int]] = defaultdict(set)
    plan = plan_hostile(config)
    for planned, record in zip(plan, (*phased.first.records, *phased.second.records), strict=True):
        touched[record.partition].add(planned.transaction)
    for p in range(full.partitions):
        lso, hw = wait_stable(stack_settings, full.topic, p)
        assert lso == hw
        mine = sorted(o for (q, o) in everything if q == p)
        assert hw == len(mine) + len(touched[p])
        assert hw > mine[-1] + 1  # the last transaction's marker follows the last record


def test_skew_breaks_timestamp_order_and_offsets_own_the_hour(phased: Phased) -> None:
    full = phased.full
    drops = 0
    by_partition: dict[int, list[HostileRecord]] = defaultdict(list)
    for r in full.committed():
        by_partition[r.partition].append(r)
    for records in by_partition.values():
        drops += sum(b.timestamp_ms < a.timestamp_ms for a, b in itertools.pairwise(records))
    assert drops > 10
    owner = hour_of(full, phased.hours, phased.joined)
    by_position = full.by_position()
    wrong_side = [
        pos for pos, hour in owner.items() if hour != hour_floor(by_position[pos].timestamp_ms)
    ]
    assert len(wrong_side) > 3
    for pos in wrong_side:
        record = by_position[pos]
        hour = owner[pos]
        # Only ever later than its stamp: a record stamped before its hour follows (in its
        # partition) a committed record that already crossed into the hour, or opens a
        # partition created in that hour.
        assert hour > hour_floor(record.timestamp_ms)
        assert (
            record.partition in phased.joined and hour == phased.joined[record.partition]
        ) or any(
            r.offset < record.offset and r.timestamp_ms >= ms(hour)
            for r in by_partition[record.partition]
        )


def test_windows_are_chained_and_cover_each_record_once(phased: Phased) -> None:
    full, hours, joined = phased.full, phased.hours, phased.joined
    window_map = windows(full, hours, joined)
    for p in range(full.partitions):
        chain = [window_map[h][p] for h in hours if p in window_map[h]]
        if p in joined:
            assert len(chain) == len(hours) - 4
            assert chain[0][0] == 0
        for (_, end), (start, _) in itertools.pairwise(chain):
            assert end == start
        assert all(lo <= hi for lo, hi in chain)
    sets = normalise_windows(full, window_map)
    covered = [pos for members in sets.values() for pos in members]
    assert len(covered) == len(set(covered))
    firsts = {p: window_map[hours[0]].get(p, (0, 0))[0] for p in range(full.partitions)}
    expected = {r.position for r in full.committed() if r.offset >= firsts[r.partition]}
    assert set(covered) == expected
    before = [r for r in full.committed() if r.offset < firsts[r.partition]]
    assert before, "the -40 s producer writes before the first hour"
    assert all(r.timestamp_ms < ms(hours[0]) for r in before)
    figures = hour_figures(full, hours, joined)
    assert sum(f.records for f in figures.values()) == len(expected)
    by_position = full.by_position()
    assert sum(f.checksum for f in figures.values()) == sum(
        record_hash(*pos, by_position[pos].key, by_position[pos].value) for pos in expected
    )
    # Sub-ranges attribute identically, whether the chain continues from the full
    # computation's boundaries or the first boundary is searched afresh.
    sub = hours[2:5]
    continued = windows(
        full, sub, joined, start_offsets={p: lo for p, (lo, _) in window_map[hours[2]].items()}
    )
    assert continued == {h: window_map[h] for h in sub}
    assert normalise_windows(full, windows(full, sub, joined)) == {h: sets[h] for h in sub}


def test_added_partitions_get_records_and_joined_at_places_them(phased: Phased) -> None:
    first, second, full, hours, joined = (
        phased.first,
        phased.second,
        phased.full,
        phased.hours,
        phased.joined,
    )
    assert {r.partition for r in first.records} == {0, 1, 2}
    assert {r.partition for r in second.committed()} == {0, 1, 2, 3, 4}
    owner = hour_of(full, hours, joined)
    new = [r for r in full.committed() if r.partition in joined]
    assert all(r.position in owner and owner[r.position] >= hours[4] for r in new)
    # A new partition's first records may be stamped before hour 4 (a slow clock): joined_at
    # puts them into hour 4, where a plain search would have put them into sealed hour 3.
    early = [r for r in new if r.timestamp_ms < ms(hours[4])]
    assert early
    plain = hour_of(full, hours)
    assert all(owner[r.position] == hours[4] for r in early)
    assert all(plain.get(r.position) != hours[4] for r in early)
    # Sealing hours 0-3 on phase 1 alone and continuing the chain from there also covers
    # every committed record from the first boundary on exactly once.
    sealed = windows(first, hours[:4])
    ends = {p: sealed[hours[3]][p][1] for p in range(3)}
    continued = windows(full, hours[4:], joined, start_offsets=ends)
    sets = {**normalise_windows(first, sealed), **normalise_windows(full, continued)}
    covered = [pos for members in sets.values() for pos in members]
    assert len(covered) == len(set(covered))
    firsts = {p: sealed[hours[0]][p][0] for p in range(3)} | {3: 0, 4: 0}
    assert set(covered) == {r.position for r in full.committed() if r.offset >= firsts[r.partition]}
    # It is not the same as computing the chain over the whole log afterwards: a phase-2 record
    # of an old partition stamped before 04:00 (slow clock), with no record >= 04:00 in phase 1,
    # would reopen sealed hour 3. Sealed hours must keep their end offsets.
    sealed_owner = {pos: hour for hour, members in sets.items() for pos in members}
    full_owner = hour_of(full, hours, joined)
    moved = {pos for pos in full_owner if full_owner[pos] != sealed_owner.get(pos)}
    assert moved
    phase2 = {r.position for r in second.records}
    by_position = full.by_position()
    for pos in moved:
        assert pos in phase2 and pos[0] < 3
        assert by_position[pos].timestamp_ms < ms(hours[4])
        assert (full_owner[pos], sealed_owner[pos]) == (hours[3], hours[4])


def test_corrections_conflict_and_resends_collapse(phased: Phased) -> None:
    full = phased.full
    versions: dict[str, list[HostileRecord]] = defaultdict(list)
    for r in full.committed():
        if r.value is not None and r.event_id is not None:
            versions[r.event_id].append(r)
    winners = events(full)
    found = conflicts(full)
    assert set(winners) == set(versions)
    assert found
    for eid, records in versions.items():
        best = max(records, key=lambda r: (r.timestamp_ms, r.partition, r.offset))
        assert winners[eid] == best
        distinct = len({r.value for r in records})
        assert found.get(eid, 1) == distinct
    assert all(any(r.kind == "correction" for r in versions[eid]) for eid in found)
    collapsed = [eid for eid, rs in versions.items() if len(rs) > 1 and eid not in found]
    assert collapsed, "identical re-sends collapse into one event"
    assert all({r.kind for r in versions[eid]} == {"event", "resend"} for eid in collapsed)
    # A re-send after the partitions were added may land in another partition than its original.
    assert any(len({r.partition for r in versions[eid]}) > 1 for eid in versions)
    # Records of aborted transactions exist nowhere.
    ghosts = {r.event_id for r in full.aborted() if r.event_id} - set(versions)
    assert ghosts
    assert not ghosts & set(winners)
    # Winners feed the hourly and current expectations.
    hourly = expected_hourly(full)
    assert sum(f.events for f in hourly.values()) == len(winners)
    assert sum(f.amount_minor for f in hourly.values()) == sum(
        r.payload()["amount_minor"] for r in winners.values()
    )
    current = expected_current(full)
    tombstoned = {r.key.decode() for r in full.committed() if r.value is None and r.key}
    assert {o for o, row in current.items() if row.deleted} <= tombstoned
    assert any(row.deleted for row in current.values())
    assert set(current) == {r.payload()["order_id"] for r in winners.values()} | tombstoned


def test_open_transaction_holds_the_last_stable_offset(stack_settings: Settings) -> None:
    config = HostileConfig(
        start=START,
        topic=f"hostile-open-{uuid.uuid4().hex[:8]}",
        partitions=1,
        hours=1,
        events_per_hour=8,
        seed=2,
        abort_share=0.0,
    )
    produced = generate(stack_settings, config)
    topic = config.topic
    lso, hw = wait_stable(stack_settings, topic, 0)
    assert lso == hw > produced.records[-1].offset
    handle = open_transaction(stack_settings, topic, 0, at(0, 30))
    offset = handle.record.offset
    assert offset == hw  # the next free offset
    assert log_ends(stack_settings, topic, 0) == (offset, offset + 1)
    assert (0, offset) not in read_topic(stack_settings, topic, "read_committed")
    time.sleep(0.5)  # still held back while the transaction stays open
    assert log_ends(stack_settings, topic, 0) == (offset, offset + 1)
    committed = handle.commit()
    assert committed.committed
    # The commit marker takes the next offset; it is written just after commit returns.
    assert wait_stable(stack_settings, topic, 0) == (offset + 2, offset + 2)
    seen = read_topic(stack_settings, topic, "read_committed")
    assert seen[(0, offset)] == (committed.timestamp_ms, committed.key, committed.value)
    with pytest.raises(GeneratorError, match="already finished"):
        handle.commit()
    # An aborted one leaves its record and marker behind, visible to nobody committed.
    handle = open_transaction(stack_settings, topic, 0, at(0, 40))
    assert handle.record.offset == offset + 2
    assert log_ends(stack_settings, topic, 0) == (offset + 2, offset + 3)
    assert not handle.abort().committed
    assert wait_stable(stack_settings, topic, 0) == (offset + 4, offset + 4)
    assert set(read_topic(stack_settings, topic, "read_committed")) == set(seen)


def test_compacted_topic_truth_comes_from_the_log(
    stack_settings: Settings, compacted_run: tuple[HostileConfig, HostileTruth]
) -> None:
    config, produced = compacted_run
    committed = produced.committed()
    deadline = time.monotonic() + 90
    while True:
        survived = truth_from_log(stack_settings, config.topic)
        if len(survived.records) < len(committed) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(survived.records) < len(committed), "the log cleaner removed nothing"
    by_position = produced.by_position()
    for r in survived.records:
        original = by_position[r.position]
        assert original.committed
        assert (r.timestamp_ms, r.key, r.value, r.event_id, r.producer) == (
            original.timestamp_ms,
            original.key,
            original.value,
            original.event_id,
            original.producer,
        )
    # Compaction keeps at least the latest committed record of every key in every partition.
    latest: dict[tuple[int, bytes | None], int] = {}
    for r in committed:
        latest[(r.partition, r.key)] = max(latest.get((r.partition, r.key), -1), r.offset)
    assert {(p, o) for (p, _), o in latest.items()} <= {r.position for r in survived.records}
    # The surviving log is a truth like any other.
    assert survived.partitions == config.partitions
    assert {r.kind for r in survived.records} <= {"event", "resend", "correction", "tombstone"}
    winners = events(survived)
    assert set(expected_current(survived)) >= {r.payload()["order_id"] for r in winners.values()}
    assert windows(survived, config.hour_starts())
    # A compacted topic must be new.
    with pytest.raises(GeneratorError, match="could not create compacted topic"):
        create_topic(stack_settings, config)


EMPTIED_HOUR = datetime(2026, 8, 10, tzinfo=UTC)


@pytest.fixture(scope="module")
def emptied_topic(stack_settings: Settings) -> tuple[str, list[int]]:
    """A compacted topic whose first segment the log cleaner has emptied, and the offsets it
    still holds: 30 records 6 minutes apart from ``EMPTIED_HOUR``, versions of 5 keys but for
    5 unique keys in the second hour; the survivors are offsets 10-14 (second hour) and the
    last versions (third hour). Kafka then answers ListOffsets by time with -1 for every
    earlier time: it searches only the first segment whose largest timestamp reaches the time,
    and an empty segment counts its file's modification time."""
    from confluent_kafka import Producer

    from backfill_assets.stack.kafka import KafkaClient
    from backfill_assets_tests.support.hostile import COMPACTED_TOPIC_CONFIGS

    topic = f"emptied_{uuid.uuid4().hex[:8]}"
    admin = KafkaClient(stack_settings).admin()
    created = admin.create_topics(
        [NewTopic(topic, 1, 1, config={**TOPIC_CONFIGS, **COMPACTED_TOPIC_CONFIGS})]
    )
    created[topic].result()
    producer = Producer(stack_settings.kafka.client_config())
    for n in range(30):
        key = f"u{n}" if 10 <= n < 15 else f"k{n % 5}"
        at = EMPTIED_HOUR + timedelta(minutes=6 * n)
        producer.produce(topic, key=key.encode(), value=b"v%d" % n, timestamp=ms(at))
        producer.flush()
        time.sleep(0.15)
    segments = stack_settings.kafka_data_dir / "logs" / f"{topic}-0"
    deadline = time.monotonic() + 120
    while True:
        sizes = [f.stat().st_size for f in sorted(segments.glob("*.log"))]
        if sizes and sizes[0] == 0 and any(sizes[1:]):
            break
        assert time.monotonic() < deadline, f"the cleaner emptied no first segment: {sizes}"
        time.sleep(1)
    survivors = _offsets_in_log(stack_settings, topic)
    # The active segment is never cleaned, so a version before it can survive too.
    assert survivors[:5] == [*range(10, 15)] and survivors[5] >= 20, survivors
    return topic, survivors


def test_a_partition_whose_first_segment_the_cleaner_emptied_keeps_its_records(
    stack_settings: Settings, emptied_topic: tuple[str, list[int]]
) -> None:
    """The hours' windows of a compacted partition whose first segment the cleaner emptied
    still hold the surviving records, not start at the end (Kafka's -1 is checked)."""
    from backfill_assets.lake.offsets import scan as offset_scan
    from backfill_assets.stack.kafka import KafkaClient

    topic, survivors = emptied_topic
    later = [o for o in survivors if o >= 20]
    got = offset_scan.scan(
        KafkaClient(stack_settings), topic, EMPTIED_HOUR, EMPTIED_HOUR + timedelta(hours=3)
    )
    cells = {
        hour: (cell.records, cell.first_offset, cell.last_offset)
        for hour, per in got.cells.items()
        for cell in per.values()
        if cell.records
    }
    assert cells == {
        EMPTIED_HOUR + timedelta(hours=1): (5, 10, 14),
        EMPTIED_HOUR + timedelta(hours=2): (len(later), later[0], later[-1]),
    }


def test_the_gap_look_up_finds_every_hour_of_a_partition_the_cleaner_emptied_first(
    stack_settings: Settings, emptied_topic: tuple[str, list[int]]
) -> None:
    """The gap sensor's look-up (``detect.kafka_hours``) past its read budget probes the rest
    by ListOffsets by time, whose -1 for such a partition would make every later hour look
    empty: the sensor would never fill them. Past the budget it must find what a full read
    finds; the probe alone (``hours_with_records``) too."""
    from backfill_assets.lake.coverage import detect
    from backfill_assets.stack.kafka import KafkaClient

    topic, survivors = emptied_topic
    client = KafkaClient(stack_settings)
    (low, end), boundary = client.watermarks(topic)[0], min(o for o in survivors if o >= 20)
    until = EMPTIED_HOUR + timedelta(hours=3)
    full = detect.kafka_hours(client, topic, EMPTIED_HOUR, until)
    second, third = EMPTIED_HOUR + timedelta(hours=1), EMPTIED_HOUR + timedelta(hours=2)
    assert full == {second: {0: (low, boundary)}, third: {0: (boundary, end)}}
    assert detect.kafka_hours(client, topic, EMPTIED_HOUR, until, read_budget=1) == full
    assert detect.hours_with_records(client, topic, EMPTIED_HOUR, until) == full


def test_the_gap_sensor_requests_every_hour_of_a_partition_the_cleaner_emptied_first(
    stack_settings: Settings,
    emptied_topic: tuple[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same look-up through the path the daemon takes: one tick of the topic's gap sensor,
    its read budget (``BACKFILL_GAP_READ_BUDGET``) set to one record so that the rest of the
    partition is probed. It requests exactly the two hours that hold records, as one raw run."""
    import dagster as dg

    from backfill_assets.defs.assets import build_topic_assets
    from backfill_assets.defs.definitions import RESOURCES, SPECS
    from backfill_assets.defs.sensors import REQUEST_TAG, build_gap_sensor
    from backfill_assets.lake.coverage.detect import PARTITION_FMT
    from backfill_assets.spec.declared import renamed

    topic, _survivors = emptied_topic
    monkeypatch.setenv("BACKFILL_GAP_READ_BUDGET", "1")
    assert Settings.from_env().gap_read_budget == 1
    spec = renamed(SPECS[0], topic=topic, partition_start=EMPTIED_HOUR)
    sensor = build_gap_sensor(spec)
    defs = dg.Definitions(assets=build_topic_assets(spec), sensors=[sensor], resources=RESOURCES)
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources=RESOURCES, definitions=defs)
        requests = sensor.evaluate_tick(context).run_requests or []
    raw = [
        (
            r.tags["dagster/asset_partition_range_start"],
            r.tags["dagster/asset_partition_range_end"],
        )
        for r in requests
        if r.tags[REQUEST_TAG].startswith("raw:")
    ]
    second, third = EMPTIED_HOUR + timedelta(hours=1), EMPTIED_HOUR + timedelta(hours=2)
    assert raw == [(f"{second:{PARTITION_FMT}}", f"{third:{PARTITION_FMT}}")]


def _offsets_in_log(settings: Settings, topic: str) -> list[int]:
    """The offsets partition 0 of ``topic`` still holds (read_committed), in order."""
    consumer = Consumer(
        {
            **settings.kafka.client_config(),
            "group.id": f"log-{uuid.uuid4().hex[:6]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        consumer.assign([TopicPartition(topic, 0, low)])
        offsets: list[int] = []
        while not offsets or offsets[-1] < high - 1:
            msg = consumer.poll(10)
            assert msg is not None, f"partition 0 of {topic} ended at {offsets[-1:]}, not {high}"
            if msg.error() is None:
                offsets.append(int(msg.offset() or 0))
        return offsets
    finally:
        consumer.close()
