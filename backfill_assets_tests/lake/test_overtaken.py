"""A reader never jumps to the log end: offsets deleted under a reader fail it, by name.

Retention (or ``delete_records``) can overtake a reader between the moment it reads the log's
ends and the moment it fetches. The fault is real: the broker deletes the records
(``delete_records``, what retention does segment by segment); only its moment is forced, by a
client that issues it just after the read it names, so each case is deterministic.
"""

from __future__ import annotations

import ast
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from backfill_assets.defs.definitions import SPECS
from backfill_assets.demo.generator import GeneratorConfig, GroundTruth, generate
from backfill_assets.errors import KafkaClientError, WindowError
from backfill_assets.lake.coverage import detect
from backfill_assets.lake.decode.content import RecordDecoder
from backfill_assets.lake.offsets.contract import offset_contract
from backfill_assets.lake.offsets.decode_pass import DecodePass, content_sample
from backfill_assets.lake.offsets.scan import scan
from backfill_assets.spec.declared import renamed
from backfill_assets.stack import catalog
from backfill_assets.stack.kafka import KafkaClient, offsets_gone
from backfill_assets.stack.settings import Settings

START = datetime(2026, 9, 3, tzinfo=UTC)
PACKAGE = Path(__file__).resolve().parents[2] / "backfill_assets"


class _Overtaking(KafkaClient):
    """A real client that deletes ``below`` (partition -> offset) from the topic right after
    the step named by ``at``: ``"log_ends"`` (the first look at the log's ends) or a
    :meth:`range_consumer` purpose (just before that reader fetches)."""

    def __init__(self, settings: Settings, topic: str, below: dict[int, int], at: str) -> None:
        super().__init__(settings)
        self.topic, self.below, self.at, self.fired = topic, below, at, False

    def _fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        admin = AdminClient(self.settings.kafka.client_config())
        parts = [TopicPartition(self.topic, p, o) for p, o in self.below.items()]
        for future in admin.delete_records(parts).values():
            future.result(30)

    def log_ends(self, topic: str) -> dict[int, tuple[int, int, int]]:
        ends = super().log_ends(topic)
        if self.at == "log_ends":
            self._fire()
        return ends

    def range_consumer(self, purpose: str, *, eof: bool = True) -> Any:
        if purpose == self.at:
            self._fire()
        return super().range_consumer(purpose, eof=eof)


def _topic(settings: Settings, hours: int = 3) -> tuple[str, GroundTruth]:
    topic = f"overtaken_{uuid.uuid4().hex[:8]}"
    truth = generate(
        settings,
        GeneratorConfig(topic=topic, start=START, hours=hours, events_per_hour=60, partitions=2),
    )
    return topic, truth


def _middle_of_first_hour(truth: GroundTruth) -> int:
    start, end = truth.hour_offsets[0][START.isoformat()]
    assert end - start >= 4, "the first hour of partition 0 must hold records to delete"
    return (start + end) // 2


@pytest.mark.parametrize("at", ["log_ends", "window-scan"])
def test_a_scan_overtaken_by_retention_fails_naming_the_offsets(
    stack_settings: Settings, at: str
) -> None:
    """Records deleted after the scan read the log's ends (its broker hints then answer from
    the new log start) or just before it fetches (its start offset is gone): the scan fails
    naming partition 0 and the deleted offsets; it never seals the hours at what is left."""
    topic, truth = _topic(stack_settings)
    cut = _middle_of_first_hour(truth)
    kafka = _Overtaking(stack_settings, topic, {0: cut}, at)
    with pytest.raises(WindowError) as caught:
        scan(kafka, topic, START, START + timedelta(hours=2))
    assert kafka.fired
    assert caught.value.missing == {0: (0, cut)}
    message = str(caught.value)
    assert f"topic {topic!r}" in message and "partition 0" in message
    assert f"[0, {cut})" in message


def test_a_decode_overtaken_by_retention_fails_and_sets_no_figure(
    stack_settings: Settings,
) -> None:
    """The independent decode reads the window again in a thread while Spark writes. Records
    deleted just before it fetches fail it by name when the checks wait for it, and no decoded
    figure is set: the content check cannot pass on a partial decode."""
    topic, truth = _topic(stack_settings)
    cut = _middle_of_first_hour(truth)
    kafka = _Overtaking(stack_settings, topic, {0: cut}, "content-decode")
    spec = renamed(SPECS[0], topic=topic)
    contract = offset_contract(
        kafka, topic, START, START + timedelta(hours=2), decode=RecordDecoder(spec)
    )
    windows = contract.windows
    assert windows is not None and windows.records > 0
    with pytest.raises(WindowError) as caught:
        windows.wait_decode()
    assert kafka.fired
    assert caught.value.missing == {0: (0, cut)}
    assert f"[0, {cut})" in str(caught.value)
    assert not windows.decoded
    assert all(c.decoded_rows == 0 for row in windows.cells.values() for c in row.values())
    with pytest.raises(WindowError):  # every later reader of the figures is refused too
        windows.hour_figures()


def test_a_second_read_that_is_not_the_scans_fails_naming_the_cell(
    stack_settings: Settings,
) -> None:
    """The decode's read must hold exactly the records the scan counted: a cell whose count or
    hash differs (here the scan's figure is altered, as a log rewritten between the reads
    would make it) fails naming the topic, partition, hour and offsets."""
    topic, _truth = _topic(stack_settings, hours=2)
    spec = renamed(SPECS[0], topic=topic)
    kafka = KafkaClient(stack_settings)
    windows = scan(kafka, topic, START, START + timedelta(hours=2))
    cell = windows.cells[START + timedelta(hours=1)][1]
    assert cell.records > 0
    cell.hash_sum += 1
    sample = content_sample(windows, 16, 50_000, 0, frozenset())
    DecodePass(kafka, windows, RecordDecoder(spec), sample).start()
    with pytest.raises(WindowError) as caught:
        windows.wait_decode()
    hour = (START + timedelta(hours=1)).isoformat()
    assert f"partition 1 hour {hour}: offsets [{cell.start}, {cell.end})" in str(caught.value)
    assert caught.value.missing == {1: (cell.start, cell.end)}
    assert not windows.decoded


def test_a_gap_reader_overtaken_by_retention_fails_naming_the_partition(
    stack_settings: Settings,
) -> None:
    """The gap sensor's reader, overtaken the same way, fails its tick by name instead of
    judging hours from records it never read; the next look at the log succeeds."""
    topic, truth = _topic(stack_settings)
    cut = _middle_of_first_hour(truth)
    spec = renamed(SPECS[0], topic=topic)
    cat = catalog.load(stack_settings.catalog)
    ns = stack_settings.catalog.namespace
    now = datetime.now(UTC)
    kafka = _Overtaking(stack_settings, topic, {0: cut}, "gap-scan")
    with pytest.raises(KafkaClientError, match=rf"topic '{topic}' partition 0: offsets from 0 "):
        detect.find(kafka, cat, ns, spec, now=now)
    assert kafka.fired
    # The next tick reads the log as it stands: every hour still holding records is a gap.
    after = detect.find(KafkaClient(stack_settings), cat, ns, spec, now=now)
    assert after.raw_gaps == [START + timedelta(hours=h) for h in range(3)]


def test_a_range_reader_below_the_log_start_gets_an_error_not_a_jump(
    stack_settings: Settings,
) -> None:
    """The package's one way to read offset ranges, assigned below the log start, answers
    an error that :func:`offsets_gone` recognises, never the records at the log's end."""
    topic, truth = _topic(stack_settings, hours=1)
    cut = _middle_of_first_hour(truth)
    _Overtaking(stack_settings, topic, {0: cut}, "now")._fire()
    consumer = KafkaClient(stack_settings).range_consumer("test-overtaken")
    try:
        consumer.assign([TopicPartition(topic, 0, 1)])
        seen: list[Any] = []
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        while not seen and datetime.now(UTC) < deadline:
            seen = consumer.consume(num_messages=10, timeout=1.0)
    finally:
        consumer.close()
    assert seen, "the reader answered nothing within 30 s"
    assert offsets_gone(seen[0].error()), [m.error() or m.offset() for m in seen]


def _consumer_calls(tree: ast.AST) -> list[ast.Call]:
    def named(call: ast.Call) -> bool:
        f: Callable[[], object] | Any = call.func
        return (isinstance(f, ast.Name) and f.id == "Consumer") or (
            isinstance(f, ast.Attribute) and f.attr == "Consumer"
        )

    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and named(n)]


def test_every_consumer_states_its_offset_reset() -> None:
    """Consumers are made in one module, and each states ``auto.offset.reset``: no reader in
    the package relies on librdkafka's default (a jump to the log's end)."""
    makers: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        calls = _consumer_calls(ast.parse(source))
        if calls:
            makers[str(path.relative_to(PACKAGE))] = len(calls)
            assert source.count('"auto.offset.reset": "error"') == len(calls), path
    assert makers == {"stack/kafka.py": 2}
