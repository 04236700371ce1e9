"""Issue 51, item 7: no record wedges an hour.

When the replay and the independent reference decode read one record differently (a value
the two parsers disagree on), ``decoded_content`` fails its hour on every run, so the gap
sensor would request it forever. ``backfill-assets accept`` records, in the ledger, that an
operator judged the replay's row right: from then on that record (and only it) is left out
on both sides. The disagreement is injected through the spec's reference decoders (a wrapper
that reads two named records' amounts one cent off); real broker, Spark run and catalog,
the CLI in process.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import pytest
from confluent_kafka import Consumer, TopicPartition

from backfill_assets.defs.assets import build_raw_asset
from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, generate
from backfill_assets.lake.offsets import ledger
from backfill_assets.ops import cli
from backfill_assets.ops.cli import common
from backfill_assets.spec.declared import renamed
from backfill_assets.spec.transforms import orders
from backfill_assets.spec.transforms.reference import Payload
from backfill_assets.stack import catalog
from backfill_assets.stack.settings import Settings
from backfill_assets_tests.support.runs import materialize_range

START = datetime(2026, 4, 20, tzinfo=UTC)
HOUR = START + timedelta(hours=1)
# The event ids whose amount the reference reads one cent off (set by the test).
DISAGREE: set[str] = set()


def _off(decoded: dict[str, Any]) -> dict[str, Any]:
    if decoded.get("event_id") in DISAGREE and decoded.get("amount_minor") is not None:
        return {**decoded, "amount_minor": decoded["amount_minor"] + 1}
    return decoded


def decode_v1(payload: Payload) -> dict[str, Any]:
    return _off(orders.decode_v1(payload))


def decode_v2(payload: Payload) -> dict[str, Any]:
    return _off(orders.decode_v2(payload))


def _events(settings: Settings, topic: str, start: int, end: int) -> list[tuple[int, str]]:
    """(offset, event id) of partition 0's records in ``[start, end)`` whose value is a JSON
    object with a string event id, read here."""
    consumer = Consumer(
        {**settings.kafka.client_config(), "group.id": "t", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, 0, start)])
    out = []
    try:
        for _ in range(start, end):
            msg = consumer.poll(10)
            assert msg is not None and msg.error() is None
            try:
                value = json.loads(msg.value() or b"null")
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("event_id"), str):
                out.append((int(msg.offset()), value["event_id"]))  # type: ignore[arg-type]
    finally:
        consumer.close()
    return out


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        yield inst


def _decoded_content(result: dg.ExecuteInProcessResult) -> Any:
    [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "decoded_content"]
    return check


@pytest.mark.slow  # three runs, 55 s: the default tier stays under 15 minutes
def test_an_accepted_record_no_longer_fails_its_hour_and_only_it(
    stack_settings: Settings,
    spark_session: object,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic = f"accept_{uuid.uuid4().hex[:8]}"
    spec = renamed(
        SPECS[0],
        topic=topic,
        partition_start=START,
        tables=(),
        decoders={1: f"{__name__}:decode_v1", 2: f"{__name__}:decode_v2"},
    )
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=3, partitions=1, events_per_hour=30),
    )
    monkeypatch.setattr(common, "specs", lambda: {topic: spec})
    start, end = truth.hour_offsets[0][HOUR.isoformat()]
    (o1, id1), (o2, id2) = _events(stack_settings, topic, start, end)[3:5]
    DISAGREE.clear()
    DISAGREE.update({id1, id2})
    try:
        first = materialize_range([build_raw_asset(spec)], instance, HOUR, raise_on_error=False)
        assert not first.success
        check = _decoded_content(first)
        assert not check.passed and check.metadata["hours_that_differ"].value == [HOUR.isoformat()]
        # The failure names the two records and the command that accepts one.
        named = check.metadata["differing_records"].value
        assert [(d["partition"], d["offset"]) for d in named] == [(0, o1), (0, o2)]
        assert {d["why"] for d in named} == {"the typed values of its row differ"}
        assert f"backfill-assets accept --topic {topic} --partition 0 --offset {o1}" in str(
            check.description
        )

        # A wrong argument says what is allowed; nothing is recorded.
        code = cli.main(["accept", "--topic", topic, "--partition", "0", "--offset", str(end + 99),
                         "--reason", "x"])  # fmt: skip
        assert code == 2 and "partition 0 offset" in capsys.readouterr().err

        # Accepting one of the two records is not enough: the other still fails the hour.
        code = cli.main(["accept", "--topic", topic, "--partition", "0", "--offset", str(o1),
                         "--reason", "the reference reads a cent off", "--json"])  # fmt: skip
        assert code == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["partition"], doc["offset"]) == (0, o1)
        second = materialize_range([build_raw_asset(spec)], instance, HOUR, raise_on_error=False)
        assert not second.success
        check = _decoded_content(second)
        assert check.metadata["accepted_records"].value == [f"0:{o1}"]
        named = check.metadata["differing_records"].value
        assert [(d["partition"], d["offset"]) for d in named] == [(0, o2)]

        assert cli.main(["accept", "--topic", topic, "--partition", "0", "--offset", str(o2),
                         "--reason", "same cause"]) == 0  # fmt: skip
        third = materialize_range([build_raw_asset(spec)], instance, HOUR, raise_on_error=False)
        assert third.success
        check = _decoded_content(third)
        assert check.passed, check.description
        assert check.metadata["accepted_records"].value == [f"0:{o1}", f"0:{o2}"]
        assert "2 record(s) accepted by an operator" in str(check.description)
    finally:
        DISAGREE.clear()
    cat = catalog.load(stack_settings.catalog)
    ns = stack_settings.catalog.namespace
    raw = f"{cat.name}.{ns}.{spec.raw_table}"
    log = ledger.current_log(cat, ns, raw).identity
    assert log is not None
    assert ledger.accepted(cat, ns, raw, log) == {(0, o1), (0, o2)}
    # The replay's rows of both records are what was published.
    table = f"lake.{ns}.{spec.raw_table}"
    rows = spark_session.table(table).where(f"kafka_offset IN ({o1}, {o2})")  # type: ignore[attr-defined]
    assert rows.count() == 2


@pytest.mark.slow  # one run, about 20 s
def test_a_failed_sampled_hour_names_records_of_its_sample(
    stack_settings: Settings,
    spark_session: object,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An hour above the whole-decode threshold is compared on its 1-in-K sample; when it
    fails, the records it names are read from that sample (so an hour K times larger than
    the naming budget is still named), and each named record is one the check compared."""
    from backfill_assets.lake.decode.content import in_sample
    from backfill_assets.lake.write import record_diff

    topic = f"accept_{uuid.uuid4().hex[:8]}"
    spec = renamed(
        SPECS[0],
        topic=topic,
        partition_start=START,
        tables=(),
        decoders={1: f"{__name__}:decode_v1", 2: f"{__name__}:decode_v2"},
    )
    truth = generate(
        stack_settings,
        GeneratorConfig(topic=topic, start=START, hours=2, partitions=1, events_per_hour=80),
    )
    monkeypatch.setenv("BACKFILL_CONTENT_SAMPLE", "4")
    monkeypatch.setenv("BACKFILL_CONTENT_SAMPLE_ABOVE", "10")
    monkeypatch.setattr(record_diff, "RECORDS_PER_HOUR", 30)  # the hour holds 80 or more
    start, end = truth.hour_offsets[0][HOUR.isoformat()]
    assert end - start > 30
    DISAGREE.clear()
    DISAGREE.update(event_id for _, event_id in _events(stack_settings, topic, start, end))
    try:
        run = materialize_range([build_raw_asset(spec)], instance, HOUR, raise_on_error=False)
    finally:
        DISAGREE.clear()
    assert not run.success
    check = _decoded_content(run)
    assert check.metadata["hours_that_differ"].value == [HOUR.isoformat()]
    residue = int(check.metadata["sample_residue"].value)
    named = check.metadata["differing_records"].value
    assert named, check.description
    for record in named:
        assert record["partition"] == 0 and start <= record["offset"] < end
        assert in_sample(0, record["offset"], 4, residue=residue), record
