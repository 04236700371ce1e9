"""JSON Schema topics: Confluent's wire format around a JSON payload.

A value is magic byte 0, the registry's schema id (4 bytes, big-endian), then UTF-8 JSON. Every
id present in a window (the librdkafka scan collects them,
:attr:`backfill_assets.lake.offsets.windows.Windows.schema_ids`) is looked up in the schema registry
once per run (:func:`resolve`):

* the registry has no such id: its records are quarantined ``unknown_schema_id:<id>``;
* the id's schema is not a JSON Schema (an Avro or Protobuf one): ``incompatible_schema:<id>``;
* otherwise the payload after the 5-byte header is read exactly as a ``json`` topic's value
  (:func:`backfill_assets.lake.decode.parse.parse`: the same strict reader, versions, upcasters and
  column rules). The columns are the spec's; the payload is not validated against the JSON
  schema (the columns' rules are the contract).

A value shorter than the header or not starting with 0 is quarantined
``not_json_schema_wire_format``. The independent decode behind the ``decoded_content`` check
(:class:`backfill_assets.lake.decode.content.RecordDecoder`) uses :class:`WireCheck`: the header and
the id checked in plain Python against the registry with its own client, never Spark.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from backfill_assets.lake.decode import avro
from backfill_assets.lake.decode.envelope import WIRE_HEADER, schema_id

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from pyspark.sql import Column

NOT_WIRE = "not_json_schema_wire_format"


def judge(sid: int, found: tuple[str, str] | None) -> avro.Writer:
    """The disposition of schema id ``sid`` whose (type, text) in the registry is ``found``
    (None: the registry has no such id)."""
    if found is None:
        return avro.Writer(sid, reason=f"unknown_schema_id:{sid}")
    kind, text = found
    if kind != "JSON":
        return avro.Writer(sid, writer=text, reason=f"incompatible_schema:{sid}")
    return avro.Writer(sid, writer=text)


def resolve(
    url: str, ids: Iterable[int], auth: Mapping[str, str] | None = None
) -> dict[int, avro.Writer]:
    """Every schema id of ``ids`` judged (:func:`judge`) against the registry at ``url``; a
    registry that does not answer raises
    :class:`~backfill_assets.errors.RegistryUnavailable`."""
    registry = avro.client(url, auth)
    return {sid: judge(sid, avro.lookup(registry, sid)) for sid in sorted(set(ids))}


def wire_rules(writers: Mapping[int, avro.Writer]) -> list[tuple[Column, Column]]:
    """The wire-format reasons of a value (conditions over the Kafka ``value``'s id column
    ``_sid``, :func:`backfill_assets.lake.decode.envelope.id_column`), first match wins."""
    from pyspark.sql import functions as F

    sid = F.col("_sid")
    rules = [
        (sid.isNull(), F.lit(NOT_WIRE)),
        (
            ~sid.isin(list(writers)),
            F.concat(F.lit("unknown_schema_id:"), sid.cast("string")),
        ),
    ]
    for w in writers.values():
        if w.reason is not None:
            rules.append((sid == w.schema_id, F.lit(w.reason)))
    return rules


class WireCheck:
    """The independent decode's header check: the JSON payload of a value, or the reason it is
    quarantined. Each id is looked up once, with its own registry client."""

    def __init__(self, url: str, auth: Mapping[str, str] | None = None) -> None:
        self.url = url
        self.auth = dict(auth or {})
        self._registry: SchemaRegistryClient | None = None
        self._reasons: dict[int, str | None] = {}

    def __call__(self, value: bytes) -> bytes | str:
        sid = schema_id(value)
        if sid is None:
            return NOT_WIRE
        if sid not in self._reasons:
            if self._registry is None:
                self._registry = avro.client(self.url, self.auth)
            self._reasons[sid] = judge(sid, avro.lookup(self._registry, sid)).reason
        reason = self._reasons[sid]
        return value[WIRE_HEADER:] if reason is None else reason
