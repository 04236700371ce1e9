"""Per-topic transforms: upcasters from each schema version to the latest schema."""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import Column, SparkSession

# The JVM class behind StrictReader (backfill_assets/stack/java, built by stack.jars.udf_jar).
STRICT_JSON_CLASS = "backfill_assets.udf.StrictJson"
_STRICT_PATH = re.compile(r"\$(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_STRICT_TYPES = {"string", "boolean", "bigint", "int", "double"}
_DECIMAL = re.compile(r"decimal\((\d+),\s*(\d+)\)")


class NamedColumn(Protocol):
    """What :func:`identity` reads of a spec column
    (:class:`backfill_assets.spec.model.ColumnSpec`)."""

    @property
    def name(self) -> str: ...

    @property
    def type(self) -> str: ...


class StrictReader:
    """The fields the upcasters read from one payload column, read by one JVM pass instead of
    one VARIANT lookup each (:data:`STRICT_JSON_CLASS`, same rules as :func:`json_field`).

    While :func:`reading` it, :func:`json_field` on ``payload`` (the very column object the
    upcasters were given) records ``(path, type)`` and returns a field of the struct column
    ``column``; :meth:`call` then builds that struct from the value text. Paths other than
    ``$.name[.name...]`` and types the JVM reader does not know fall back to the VARIANT."""

    def __init__(self, payload: Column, column: str) -> None:
        self.payload = payload
        self.column = column
        self.fields: dict[tuple[str, str], str] = {}

    def field(self, path: str, spark_type: str) -> Column | None:
        """The struct field that will hold ``path`` as ``spark_type`` (``present``: whether the
        field exists), or None if the JVM reader cannot read it."""
        from pyspark.sql import functions as F

        decimal = _DECIMAL.fullmatch(spark_type)
        if decimal:
            spark_type = f"decimal({decimal[1]},{decimal[2]})"
        elif spark_type not in _STRICT_TYPES and spark_type != "present":
            return None
        if not _STRICT_PATH.fullmatch(path):
            return None
        name = self.fields.setdefault((path, spark_type), f"f{len(self.fields)}")
        return F.col(self.column).getField(name)

    def whole(self) -> Column:
        """Whether the value is exactly one JSON value (false for invalid JSON, NULL for a NULL
        value)."""
        from pyspark.sql import functions as F

        return F.col(self.column).getField("whole")

    def is_object(self) -> Column:
        from pyspark.sql import functions as F

        return F.col(self.column).getField("object")

    def call(self, spark: SparkSession, text: Column) -> Column:
        """The struct ``(whole, object, f0, f1, ...)`` for the value ``text`` (a string)."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import _parse_datatype_string

        request = "".join(f"{path}\t{kind}\n" for (path, kind) in self.fields)
        fields = ", ".join(
            f"{name}: {'boolean' if kind == 'present' else kind}"
            for (_, kind), name in self.fields.items()
        )
        struct = f"struct<whole: boolean, object: boolean{', ' if fields else ''}{fields}>"
        name = "backfill_strict_json_" + hashlib.sha256(request.encode()).hexdigest()[:16]
        # The name says what it returns. A session remembers its functions, so each session is
        # asked about a name once: over Spark Connect, functionExists is a round trip.
        known = _REGISTERED.setdefault(spark, set())
        if name not in known:
            if not spark.catalog.functionExists(name):
                struct_type = _parse_datatype_string(struct)
                spark.udf.registerJavaFunction(name, STRICT_JSON_CLASS, struct_type)
            known.add(name)
        return F.call_function(name, text, F.lit(request))


# Per live session: the StrictReader functions it is known to have.
_REGISTERED: weakref.WeakKeyDictionary[SparkSession, set[str]] = weakref.WeakKeyDictionary()


_READER: ContextVar[StrictReader | None] = ContextVar("strict_reader", default=None)


@contextmanager
def reading(reader: StrictReader) -> Iterator[StrictReader]:
    """Route :func:`json_field` calls on ``reader.payload`` to ``reader`` in this block."""
    token = _READER.set(reader)
    try:
        yield reader
    finally:
        _READER.reset(token)


def json_field(v: Column, path: str, spark_type: str) -> Column:
    """The JSON value at ``path`` as ``spark_type``, or NULL when it is absent, JSON ``null``,
    or of another JSON kind, or would change in the conversion.

    Strings come only from JSON strings, booleans only from ``true``/``false``, and numeric
    types only from JSON numbers that convert without loss: ``12.7`` is not a ``bigint``,
    ``12.345`` not a ``decimal(18,2)``, ``1e30`` not a ``bigint`` (Spark's own variant casts
    would silently truncate, round or turn ``"123"``, ``true`` or ``{"a":1}`` into values).
    Objects and arrays never convert. Upcasters use it for every field they read, so a value
    of the wrong kind is quarantined as ``missing_or_invalid:<column>``. In the raw parse the
    field comes from the JVM reader (:class:`StrictReader`), with the same rules; there, a
    number converts only if its exact written value fits (``1e-400`` is not 0) and a double
    must be finite (``1e400`` is not infinity).
    """
    from pyspark.sql import functions as F

    reader = _READER.get()
    if reader is not None and v is reader.payload:
        strict = reader.field(path, spark_type)
        if strict is not None:
            return strict

    # The field is looked up once; its kind and typed value are read from that one value (Spark
    # evaluates a subexpression shared by the condition and the result once per row).
    field = F.try_variant_get(v, path, "variant")
    kind = F.schema_of_variant(field)
    value = F.try_variant_get(field, "$", spark_type)
    if spark_type == "string":
        ok = kind == F.lit("STRING")
    elif spark_type == "boolean":
        ok = kind == F.lit("BOOLEAN")
    else:
        integer = kind == F.lit("BIGINT")  # how the variant stores every JSON integer
        fraction = kind.isin("DOUBLE", "FLOAT") | kind.startswith("DECIMAL")
        if spark_type in ("double", "float"):
            ok = integer | fraction
        else:
            # Only a number written with a fraction or exponent can lose anything.
            exact = F.try_variant_get(field, "$", "decimal(38,18)")
            ok = integer | (fraction & (value.cast("decimal(38,18)") == exact))
    return F.when(ok, value)


# Epoch milliseconds Spark's timestamp_millis accepts without overflow (years 0001..9999); a
# value outside stays NULL instead of failing the whole run.
MIN_EPOCH_MS, MAX_EPOCH_MS = -62_135_596_800_000, 253_402_300_799_999

# The one grammar of a timestamp written as text, which the replay (Spark) and the content
# check's reference decode (Python) both follow: ISO-8601 ``yyyy[-m[m][-d[d][(T| )h[h]:m[m]
# [:s[s][.fraction]]]]]`` with an optional zone ``Z``, ``UTC``, ``GMT`` or ``+-h[h][[:]mm]``
# (none: UTC), padded by spaces, tabs or line breaks at most. Spark's cast accepts more
# spellings (region zone names such as ``Europe/Paris``, and so local times in a daylight-saving
# gap) that the reference could only imitate; any such value is NULL on both sides, so the two
# never disagree on it (the contract then judges the NULL like any missing value).
TIMESTAMP_TEXT = (
    r"(?P<y>\d{4})(?:-(?P<mo>\d{1,2})(?:-(?P<d>\d{1,2})"
    r"(?:[T ](?P<h>\d{1,2}):(?P<mi>\d{1,2})(?::(?P<s>\d{1,2})(?:\.(?P<f>\d*))?)?)?)?)?"
    r"(?P<z>Z|UTC|GMT|[+-]\d{1,2}(?::?\d{2})?)?"
)
TIMESTAMP_PADDING = " \t\n\r"


def json_timestamp(v: Column, path: str) -> Column:
    """A timestamp from a JSON integer (epoch milliseconds) or a JSON string in the grammar of
    :data:`TIMESTAMP_TEXT` (without an offset it is read as UTC, the session's zone); NULL for
    any other kind or value."""
    from pyspark.sql import functions as F

    millis = json_field(v, path, "bigint")
    text = json_field(v, path, "string")
    return F.coalesce(
        F.when(millis.between(MIN_EPOCH_MS, MAX_EPOCH_MS), F.timestamp_millis(millis)),
        text_timestamp(text),
    )


def text_timestamp(text: Column) -> Column:
    """A timestamp from a string in the grammar of :data:`TIMESTAMP_TEXT` (Spark's cast,
    session zone UTC), NULL for any other string: what upcasters use to read a text time, so
    the reference decode (``reference.text_timestamp``) reads it alike."""
    from pyspark.sql import functions as F

    return F.when(text.rlike(_TIMESTAMP_TEXT_JAVA), F.try_to_timestamp(text))


# TIMESTAMP_TEXT as a Java regex over the whole text (rlike finds; Java names groups (?<n>).
_TIMESTAMP_TEXT_JAVA = (
    rf"^[{TIMESTAMP_PADDING}]*(?:{TIMESTAMP_TEXT.replace('(?P<', '(?<')})[{TIMESTAMP_PADDING}]*\z"
)


def identity(columns: Sequence[NamedColumn]) -> Callable[[Column], dict[str, Column]]:
    """The upcaster of a version whose fields are the columns: each column read from the field
    of the same name with :func:`json_field`'s strict typing (timestamps with
    :func:`json_timestamp`)."""

    def upcast(v: Column) -> dict[str, Column]:
        return {
            c.name: json_timestamp(v, f"$.{c.name}")
            if c.type == "timestamp"
            else json_field(v, f"$.{c.name}", c.type)
            for c in columns
        }

    return upcast
