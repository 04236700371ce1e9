"""The demo's orders in Avro: the same planned records, in Confluent's wire format.

:class:`Encoder` takes the events :func:`~backfill_assets.demo.generator.plan_events` planned
(JSON values) and serializes each with confluent-kafka's ``AvroSerializer`` against the schema
registry: magic byte 0, the schema id of the subject ``<topic>-value``, Avro binary. The JSON
schema versions map to two registered Avro versions:

* v1: ``amount_minor`` an int, no ``channel``;
* v2 (BACKWARD-compatible): ``amount_minor`` widened to long, ``channel`` added with the
  default ``"unknown"`` (what the JSON upcaster gives v1 events), so a reader built from the
  latest schema reads v1 records with that channel.

Duplicates keep their original's bytes, tombstones stay NULL and malformed records keep their
raw JSON bytes, which are not in the wire format, so the raw asset quarantines them
(``not_avro_wire_format``). Everything else about the plan (keys, partitions, timestamps,
labels) is unchanged, so the ground truth is built from it as for JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from backfill_assets.errors import GeneratorError

_NAME = {"type": "record", "name": "OrderEvent", "namespace": "backfill_assets.demo"}
_STRING = ("event_id", "order_id", "customer_id", "event_type", "status", "currency")
_TIME = {"name": "event_time", "type": {"type": "long", "logicalType": "timestamp-millis"}}


def _schema(version: int) -> str:
    fields: list[dict[str, Any]] = [{"name": n, "type": "string"} for n in _STRING]
    fields.append({"name": "amount_minor", "type": "int" if version == 1 else "long"})
    if version == 2:
        fields.append({"name": "channel", "type": "string", "default": "unknown"})
    fields.append(_TIME)
    return json.dumps({**_NAME, "fields": fields})


SCHEMAS: dict[int, str] = {1: _schema(1), 2: _schema(2)}


def subject(topic: str) -> str:
    """The subject the demo registers its schemas under (the spec's default)."""
    return f"{topic}-value"


def register(url: str, topic: str, auth: Mapping[str, str] | None = None) -> dict[int, int]:
    """Register both versions under ``<topic>-value`` (BACKWARD compatibility); return the
    registry's schema id of each JSON schema version. Registering again returns the same ids."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    client = SchemaRegistryClient({"url": url, **(auth or {})})
    name = subject(topic)
    try:
        ids = {1: client.register_schema(name, Schema(SCHEMAS[1], "AVRO"))}
        client.set_compatibility(name, "BACKWARD")
        ids[2] = client.register_schema(name, Schema(SCHEMAS[2], "AVRO"))
    except Exception as exc:
        raise GeneratorError(
            f"could not register the demo's Avro schemas under {name!r} at {url}: {exc}; "
            "check the schema registry (backfill-assets stack status)"
        ) from exc
    return ids


class Encoder:
    """Serializes the demo's valid events in Avro through the registry at ``url``, under
    ``<topic>-value`` (both versions registered first). Planning knows nothing of Avro: the
    generator hands each planned event over (demo/generator.py, ``_encoded``)."""

    def __init__(self, url: str, topic: str, auth: Mapping[str, str] | None = None) -> None:
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.avro import AvroSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        self.ids = register(url, topic, auth)
        client = SchemaRegistryClient({"url": url, **(auth or {})})
        self._serializers = {
            v: AvroSerializer(client, text, conf={"auto.register.schemas": False})
            for v, text in SCHEMAS.items()
        }
        self._ctx = SerializationContext(topic, MessageField.VALUE)
        self._done: dict[bytes, bytes] = {}  # JSON value -> Avro value: duplicates keep bytes

    def __call__(self, event: Event) -> bytes:
        """``event``'s value (its JSON bytes) in Confluent's wire format."""
        if event.value is None or event.schema_version not in self._serializers:
            raise GeneratorError(f"not a valid demo event: {event!r}")
        value = self._done.get(event.value)
        if value is None:
            data = self._serializers[event.schema_version](_fields(event, event.value), self._ctx)
            if not isinstance(data, bytes):
                raise GeneratorError(f"AvroSerializer returned no bytes for {event!r}")
            value = self._done[event.value] = data
        return value


class Event(Protocol):
    """What the encoder reads of a planned valid event (generator.PlannedRecord)."""

    @property
    def value(self) -> bytes | None: ...
    @property
    def schema_version(self) -> int | None: ...
    @property
    def event_id(self) -> str | None: ...
    @property
    def order_id(self) -> str: ...
    @property
    def event_type(self) -> str | None: ...
    @property
    def status(self) -> str | None: ...
    @property
    def currency(self) -> str | None: ...
    @property
    def amount_minor(self) -> int | None: ...
    @property
    def event_time_ms(self) -> int | None: ...


def _fields(event: Event, value: bytes) -> dict[str, Any]:
    """The Avro record of a valid event: its labels, plus what only its JSON ``value`` holds."""
    payload = json.loads(value)
    fields = {
        "event_id": event.event_id,
        "order_id": event.order_id,
        "customer_id": payload["customer_id"],
        "event_type": event.event_type,
        "status": event.status,
        "currency": event.currency,
        "amount_minor": event.amount_minor,
        "event_time": event.event_time_ms,
    }
    if event.schema_version == 2:
        fields["channel"] = payload["channel"]
    return fields
