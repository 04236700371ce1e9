"""Python reference decoders: the reading rules of
:func:`~backfill_assets.spec.transforms.json_field` and
:func:`~backfill_assets.spec.transforms.json_timestamp`, written again in plain Python.

The raw table's ``decoded_content`` check (:mod:`backfill_assets.lake.decode.content`) decodes every
Kafka record of a window with these, independently of Spark's parse and of the upcasters, and
compares the typed values with the rows stored on the run's branch. A topic's spec names one
reference per schema version (``decoders`` in topics.yaml); a version read as the columns say
(``latest_version`` without an upcaster) has :func:`identity` as its reference.

A reference takes the payload as :func:`loads` returns it (JSON integers as :class:`int`, other
numbers as :class:`Decimal`, so nothing is rounded on the way) and returns the latest schema's
columns: strings as ``str``, integers as ``int``, booleans as ``bool``, doubles as ``float``,
timestamps as epoch **microseconds** (Spark's own unit); ``None`` where the value is absent or
cannot be read without coercion, exactly where the Spark reading gives NULL.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

from backfill_assets.spec.transforms import (
    MAX_EPOCH_MS,
    MIN_EPOCH_MS,
    TIMESTAMP_PADDING,
    TIMESTAMP_TEXT,
    NamedColumn,
)

Payload = Mapping[str, Any]
Reference = Callable[[Payload], Mapping[str, Any]]

_DECIMAL = re.compile(r"decimal\((\d+),\s*(\d+)\)")
_LONG = (-(1 << 63), (1 << 63) - 1)
_INT = (-(1 << 31), (1 << 31) - 1)
_BOUNDS = {"bigint": _LONG, "int": _INT}
_MISSING = object()


class InvalidJson(ValueError):
    """The text is not exactly one JSON value under the strict reader's rules."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise InvalidJson("duplicate name")
    return obj


def _constant(name: str) -> Any:
    raise InvalidJson(f"{name} is not JSON")


# Integers stay int (the C scanner's own conversion): a Decimal per integer made them a fifth of
# the decode's time, and field reads both the same way.
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_float=Decimal, parse_constant=_constant)


def loads(text: str) -> Any:
    """Exactly one JSON value (whitespace around it allowed), as the JVM strict reader accepts
    it: no duplicate names in any object, no NaN/Infinity, no byte-order mark, no trailing
    data. Integers are :class:`int`, other numbers :class:`Decimal`. Raises :class:`InvalidJson`.

    Nesting: Python's parser stops at its recursion limit (about 1000 levels, like the JVM
    reader's); a value nested within a few levels of that limit may be judged differently."""
    if text.startswith("\ufeff"):
        raise InvalidJson("byte-order mark")
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError, InvalidOperation) as exc:
        raise InvalidJson(str(exc)) from None


def lookup(payload: Payload, path: str) -> Any:
    """The value at ``path`` (``name`` or ``name.name...``), or :data:`MISSING`."""
    if "." not in path:
        return payload.get(path, _MISSING)
    value: Any = payload
    for name in path.split("."):
        if not isinstance(value, dict) or name not in value:
            return _MISSING
        value = value[name]
    return value


MISSING = _MISSING


def present(payload: Payload, path: str) -> bool:
    """Whether the field exists, whatever its value (JSON ``null`` included)."""
    return lookup(payload, path) is not _MISSING


def field(payload: Payload, path: str, spark_type: str) -> Any:
    """:func:`~backfill_assets.spec.transforms.json_field` in Python: the value at ``path`` as
    ``spark_type``, or None when absent, ``null``, of another JSON kind or not exactly
    convertible."""
    value = payload.get(path) if "." not in path else lookup(payload, path)
    if spark_type == "string":
        return value if isinstance(value, str) else None
    if spark_type == "boolean":
        return value if isinstance(value, bool) else None
    if type(value) is int:  # a JSON integer (a bool is not one)
        return _whole(value, spark_type)
    if not isinstance(value, Decimal):
        return None
    return _number(value, spark_type)


def _whole(value: int, spark_type: str) -> Any:
    """:func:`_number` of an integer, without a Decimal on the way."""
    bounds = _BOUNDS.get(spark_type)
    if bounds is not None:
        return value if bounds[0] <= value <= bounds[1] else None
    if spark_type in ("double", "float"):
        try:
            return float(value)
        except OverflowError:  # beyond a double's range: Decimal's float() was infinite
            return None
    return _number(Decimal(value), spark_type)


def _number(value: Decimal, spark_type: str) -> Any:
    if spark_type in _BOUNDS:
        return _integral(value, _BOUNDS[spark_type])
    if spark_type in ("double", "float"):
        number = float(value)
        return number if math.isfinite(number) else None
    decimal = _DECIMAL.fullmatch(spark_type)
    if decimal:
        return _decimal(value, int(decimal[1]), int(decimal[2]))
    raise ValueError(f"no reference reading for type {spark_type!r}")


def _integral(value: Decimal, bounds: tuple[int, int]) -> int | None:
    if value.is_zero():
        return 0
    if value.adjusted() > 19 or value != value.to_integral_value():
        return None
    number = int(value)
    return number if bounds[0] <= number <= bounds[1] else None


def _decimal(value: Decimal, precision: int, scale: int) -> Decimal | None:
    """The number when it has at most ``scale`` fraction digits and ``precision - scale``
    integer digits (trailing zeros do not count), as the JVM reader's ``decimal(p,s)``."""
    if value.is_zero():
        return Decimal(0)
    _sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    digits = tuple(digits)
    while len(digits) > 1 and digits[-1] == 0:
        digits, exponent = digits[:-1], exponent + 1
    own_scale = -exponent
    if own_scale > scale or len(digits) - own_scale > precision - scale:
        return None
    return value


def millis_timestamp(millis: int | None) -> int | None:
    """Spark's ``timestamp_millis`` of an epoch-ms value within MIN..MAX_EPOCH_MS, as epoch
    microseconds; None otherwise."""
    if millis is None or not MIN_EPOCH_MS <= millis <= MAX_EPOCH_MS:
        return None
    return millis * 1000


_TIMESTAMP = re.compile(TIMESTAMP_TEXT, re.ASCII)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def text_timestamp(text: str | None) -> int | None:
    """Spark's ``try_to_timestamp(text)`` (a cast to timestamp, session zone UTC) for the
    grammar both sides follow (:data:`backfill_assets.spec.transforms.TIMESTAMP_TEXT`); a
    fraction beyond microseconds is truncated. As epoch microseconds; None for anything else,
    as the replay's :func:`~backfill_assets.spec.transforms.json_timestamp` says NULL."""
    if text is None:
        return None
    match = _TIMESTAMP.fullmatch(text.strip(TIMESTAMP_PADDING))
    if match is None:
        return None
    g = match.groupdict()
    zone = g["z"]
    tz: timezone = UTC
    if zone and zone[0] in "+-":
        sign = -1 if zone[0] == "-" else 1
        body = zone[1:].replace(":", "")
        hours, minutes = (int(body), 0) if len(body) <= 2 else (int(body[:-2]), int(body[-2:]))
        if hours > 18 or minutes > 59:
            return None
        tz = timezone(sign * timedelta(hours=hours, minutes=minutes))
    fraction = (g["f"] or "")[:6].ljust(6, "0")
    try:
        moment = datetime(
            int(g["y"]),
            int(g["mo"] or 1),
            int(g["d"] or 1),
            int(g["h"] or 0),
            int(g["mi"] or 0),
            int(g["s"] or 0),
            int(fraction),
            tzinfo=tz,
        )
    except (ValueError, OverflowError):
        return None
    delta = moment - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def timestamp(payload: Payload, path: str) -> int | None:
    """:func:`~backfill_assets.spec.transforms.json_timestamp` in Python: an integer as epoch
    milliseconds, or an ISO-8601 string (:func:`text_timestamp`); epoch microseconds."""
    millis = millis_timestamp(field(payload, path, "bigint"))
    if millis is not None:
        return millis
    return text_timestamp(field(payload, path, "string"))


def identity(columns: Sequence[NamedColumn]) -> Reference:
    """The reference of a version whose fields are the columns
    (:func:`backfill_assets.spec.transforms.identity` in Python)."""

    def decode(payload: Payload) -> dict[str, Any]:
        return {
            c.name: timestamp(payload, c.name)
            if c.type == "timestamp"
            else field(payload, c.name, c.type)
            for c in columns
        }

    return decode
