"""Declared tables: their SQL checked against the columns it reads when the spec loads, their
dependency order, and the SQL of one run.

A declared table's SQL is one Spark SQL query with two window parameters, ``{start}`` and
``{end}`` (the run's event-time window, UTC), that reads relations by their plain names:

* ``<topic>``: the topic's events, one row per event id (the winning version, see
  :mod:`backfill_assets.lake.write.derived`), tombstones excluded, with the topic's columns and
  ``kafka_timestamp``, ``kafka_partition``, ``kafka_offset``, ``kafka_hour``;
* ``<topic>_current``: the topic's current state (its columns, ``deleted``, ``order_ts``, ...);
* any other declared table, by its name.

Validation uses sqlglot (no Spark session): a parse error, an unknown relation or column, a
missing window parameter, output columns that differ from the declared ones, a type that cannot
be the declared one, a grain or measure that names no column, or a dependency cycle fails
loading with the topic, the table and the column named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from backfill_assets.errors import SpecError
from backfill_assets.spec.model import (
    CURRENT_META_COLUMNS,
    EVENT_META_COLUMNS,
    TableSpec,
    TopicSpec,
    decimal_of,
)

if TYPE_CHECKING:
    from sqlglot import exp

WINDOW_PARAMS = ("start", "end")
_PARAM = re.compile(r"\{(\w*)\}")
_SQLGLOT_TYPES = {
    "string": "STRING",
    "bigint": "BIGINT",
    "int": "INT",
    "double": "DOUBLE",
    "boolean": "BOOLEAN",
    "timestamp": "TIMESTAMP",
}
_CLASS = {
    "string": "string",
    "bigint": "integer",
    "int": "integer",
    "double": "fractional",
    "boolean": "boolean",
    "timestamp": "timestamp",
}


@dataclass(frozen=True)
class Relation:
    """A name a declared table's SQL can read."""

    name: str
    kind: Literal["events", "current", "table"]
    topic: str
    columns: tuple[tuple[str, str], ...]  # (name, type) in the spec's type names
    event_time: str | None  # the column a window filters on (None for current state)


def relations(specs: list[TopicSpec]) -> dict[str, Relation]:
    """Every relation declared tables can read, by name."""
    out: dict[str, Relation] = {}
    for spec in specs:
        cols = tuple((c.name, c.type) for c in spec.columns)
        out[spec.name] = Relation(
            spec.name, "events", spec.topic, cols + EVENT_META_COLUMNS, spec.event_time_field
        )
        out[spec.current_table] = Relation(
            spec.current_table, "current", spec.topic, cols + CURRENT_META_COLUMNS, None
        )
        for table in spec.tables:
            out[table.name] = Relation(
                table.name,
                "table",
                spec.topic,
                tuple((c.name, c.type) for c in table.columns),
                table.event_time,
            )
    return out


def render(sql: str, start: datetime, end: datetime) -> str:
    """The SQL of one run: ``{start}``/``{end}`` become UTC timestamps (epoch milliseconds, so
    no time zone can shift them)."""
    values = {
        "start": f"timestamp_millis({int(start.timestamp() * 1000)})",
        "end": f"timestamp_millis({int(end.timestamp() * 1000)})",
    }
    return _PARAM.sub(lambda m: values.get(m.group(1), m.group(0)), sql)


def validate(specs: list[TopicSpec], path: Path) -> list[TopicSpec]:
    """Check every declared table and each topic's current-state rule; return the specs with
    each table's ``refs`` (the relations its SQL reads) filled in."""
    _check_names(specs, path)
    known = relations(specs)
    out = []
    for spec in specs:
        if spec.current is not None:
            _check_current(spec, known, path)
        tables = tuple(_check_table(spec, t, known, path) for t in spec.tables)
        out.append(spec.model_copy(update={"tables": tables}))
    ordered(out, path)  # raises on a cycle
    return out


def ordered(specs: list[TopicSpec], path: Path | str = "topics.yaml") -> list[TableSpec]:
    """Every declared table, each after the declared tables it reads."""
    tables = {t.name: t for s in specs for t in s.tables}
    done: list[TableSpec] = []
    state: dict[str, str] = {}

    def visit(name: str, chain: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            cycle = " -> ".join([*chain[chain.index(name) :], name])
            raise SpecError(
                f"{path}: topic {tables[name].topic!r}, table {name!r}: declared tables read "
                f"each other in a cycle: {cycle}"
            )
        state[name] = "visiting"
        for ref in tables[name].refs:
            if ref in tables:
                visit(ref, [*chain, name])
        state[name] = "done"
        done.append(tables[name])

    for name in tables:
        visit(name, [])
    return done


def downstream(specs: list[TopicSpec], names: set[str]) -> list[TableSpec]:
    """The declared tables that read any of ``names``, directly or through other tables, in
    dependency order."""
    out: list[TableSpec] = []
    reached = set(names)
    for table in ordered(specs):
        if reached & set(table.refs):
            out.append(table)
            reached.add(table.name)
    return out


def _check_names(specs: list[TopicSpec], path: Path) -> None:
    taken: dict[str, str] = {}
    for spec in specs:
        for name in (spec.name, spec.current_table, spec.raw_table, spec.quarantine_table):
            taken[name] = f"topic {spec.topic!r}"
    for spec in specs:
        for table in spec.tables:
            if table.name in taken:
                raise SpecError(
                    f"{path}: topic {spec.topic!r}, table {table.name!r}: the name is already "
                    f"used by {taken[table.name]}; pick another"
                )
            taken[table.name] = f"topic {spec.topic!r}, table {table.name!r}"


def _check_current(spec: TopicSpec, known: dict[str, Relation], path: Path) -> None:
    rule = spec.current_rule
    where = f"{path}: topic {spec.topic!r}, current"
    if rule.key != spec.key_field:
        raise SpecError(
            f"{where}: key {rule.key!r} must be the topic's key_field {spec.key_field!r} "
            "(a tombstone carries only the Kafka key)"
        )
    if rule.deleted_when is not None:
        _qualify(
            f"SELECT 1 AS x FROM {spec.name} WHERE {rule.deleted_when}",
            known,
            f"{where}: deleted_when",
        )


def _check_table(
    spec: TopicSpec, table: TableSpec, known: dict[str, Relation], path: Path
) -> TableSpec:
    """``table`` with the relations its SQL reads, or a :class:`SpecError` naming the first
    problem: window parameters, relations, selected columns and types, source, measures."""
    where = f"{path}: topic {spec.topic!r}, table {table.name!r}"
    _check_params(table, where)
    query = _parse(
        render(table.sql, datetime.fromtimestamp(0, UTC), datetime.fromtimestamp(3600, UTC)), where
    )
    refs = _refs(query, table, known, where)
    _check_outputs(table, _qualify(query, known, where), where)
    _check_source(table, known, refs, where)
    _check_measures(spec, table, known, where)
    return table.model_copy(update={"refs": tuple(refs)})


def _check_params(table: TableSpec, where: str) -> None:
    params = _PARAM.findall(table.sql)
    for param in WINDOW_PARAMS:
        if param not in params:
            raise SpecError(
                f"{where}: the SQL ({table.sql_origin}) never uses the window parameter "
                f"{{{param}}}; filter the rows it reads to [{{start}}, {{end}})"
            )
    unknown_params = sorted(set(params) - set(WINDOW_PARAMS))
    if unknown_params:
        raise SpecError(
            f"{where}: unknown parameter(s) {', '.join('{' + p + '}' for p in unknown_params)} "
            "in the SQL; allowed: {start}, {end}"
        )


def _refs(query: exp.Query, table: TableSpec, known: dict[str, Relation], where: str) -> list[str]:
    """The relations the SQL reads, in order (its own CTEs left out)."""
    from sqlglot import exp

    ctes = {c.alias_or_name for c in query.find_all(exp.CTE)}
    refs: list[str] = []
    for node in query.find_all(exp.Table):
        if node.name in ctes and not node.db:
            continue
        if node.db or node.catalog:
            raise SpecError(
                f"{where}: reads {node.sql(dialect='spark')}; name relations without a "
                f"catalog or namespace (known: {', '.join(sorted(known))})"
            )
        if node.name not in known:
            raise SpecError(
                f"{where}: reads unknown relation {node.name!r}; known: {', '.join(sorted(known))}"
            )
        if node.name == table.name:
            raise SpecError(f"{where}: reads itself")
        if node.name not in refs:
            refs.append(node.name)
    return refs


def _check_outputs(table: TableSpec, typed: exp.Query, where: str) -> None:
    """The SQL selects exactly the declared columns, each of a compatible type."""
    outputs = {s.alias_or_name: s for s in typed.selects}
    declared = [c.name for c in table.columns]
    missing = [c for c in declared if c not in outputs]
    extra = [c for c in outputs if c not in declared]
    if missing or extra:
        raise SpecError(
            f"{where}: the SQL's columns differ from the declared ones: "
            + "; ".join(
                part
                for part in (
                    f"declared but not selected: {missing}" if missing else "",
                    f"selected but not declared: {extra}" if extra else "",
                )
                if part
            )
        )
    for column in table.columns:
        inferred = _class(outputs[column.name].type)
        want = "fractional" if decimal_of(column.type) else _CLASS[column.type]
        if inferred is None or inferred == want:
            continue
        if want == "fractional" and inferred == "integer":
            continue  # widened when written
        raise SpecError(
            f"{where}: column {column.name!r} is declared {column.type} but the SQL gives "
            f"{_sql_type(outputs[column.name].type)}; change the declaration or cast"
        )


def _check_source(
    table: TableSpec, known: dict[str, Relation], refs: list[str], where: str
) -> None:
    source = known.get(table.source)
    if source is None or source.kind == "current" or source.name == table.name:
        allowed = sorted(n for n, r in known.items() if r.kind != "current" and n != table.name)
        raise SpecError(
            f"{where}: source {table.source!r} must be the topic's events or a declared table "
            f"(one of {', '.join(allowed)})"
        )
    if table.source not in refs:
        raise SpecError(f"{where}: source {table.source!r} is not read by its SQL")


def _check_measures(
    spec: TopicSpec, table: TableSpec, known: dict[str, Relation], where: str
) -> None:
    """Each measure's two sides are valid SQL over the table and over its source."""
    own = Relation(
        table.name,
        "table",
        spec.topic,
        tuple((c.name, c.type) for c in table.columns),
        table.event_time,
    )
    for m in table.measures:
        _qualify(
            f"SELECT {m.table} AS v FROM {table.name}",
            {**known, table.name: own},
            f"{where}: measure {m.name!r} (table side `{m.table}`)",
        )
        _qualify(
            f"SELECT {m.source} AS v FROM {table.source}",
            known,
            f"{where}: measure {m.name!r} (source side `{m.source}`)",
        )


ColumnLineage = dict[str, tuple[tuple[str, str], ...]]


def column_lineage(table: TableSpec, known: dict[str, Relation]) -> ColumnLineage:
    """Per output column of ``table``'s SQL, the (relation, column) pairs its value is computed
    from, sorted (through CTEs, subqueries and joins, by sqlglot's lineage over the qualified
    query). A column computed from no column (``count(*)``, a literal) maps to ``()``; one
    sqlglot cannot trace is left out. Columns read only by filters, joins or grouping are not
    listed: they select rows, not values."""
    from sqlglot import exp, parse_one
    from sqlglot.errors import SqlglotError
    from sqlglot.lineage import lineage
    from sqlglot.optimizer.scope import build_scope

    where = f"table {table.name!r}"
    query = _parse(
        render(table.sql, datetime.fromtimestamp(0, UTC), datetime.fromtimestamp(3600, UTC)), where
    )
    typed = _qualify(query, known, where)
    scope = build_scope(typed)
    schema = _schema(known)
    out: ColumnLineage = {}
    for select in typed.selects:
        name = select.alias_or_name
        try:
            node = lineage(
                name, typed, schema=schema, dialect="spark", scope=scope, trim_selects=False
            )
        except (SqlglotError, KeyError, ValueError):
            continue  # lineage is information: a construct sqlglot cannot trace is left out
        pairs = set()
        for leaf in node.walk():
            if leaf.downstream or not isinstance(leaf.expression, exp.Table):
                continue
            relation = leaf.expression.name
            if relation in known:
                pairs.add((relation, parse_one(leaf.name).name))
        out[name] = tuple(sorted(pairs))
    return out


def _parse(sql: str, where: str) -> exp.Query:
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import ParseError

    try:
        statements = [s for s in sqlglot.parse(sql, dialect="spark") if s is not None]
    except ParseError as err:
        raise SpecError(f"{where}: the SQL does not parse: {_first(err)}") from None
    if len(statements) != 1 or not isinstance(statements[0], exp.Query):
        raise SpecError(f"{where}: the SQL must be exactly one query (SELECT ...)")
    query = statements[0]
    if isinstance(query, exp.Select) and not (query.args.get("from_") or query.args.get("from")):
        raise SpecError(f"{where}: the SQL must read a relation (SELECT ... FROM ...)")
    return query


def _qualify(query: exp.Query | str, known: dict[str, Relation], where: str) -> exp.Query:
    from sqlglot import exp
    from sqlglot.errors import OptimizeError, ParseError
    from sqlglot.optimizer.annotate_types import annotate_types
    from sqlglot.optimizer.qualify import qualify

    if isinstance(query, str):
        query = _parse(query, where)
    schema = _schema(known)
    try:
        qualified = qualify(
            query.copy(), schema=schema, dialect="spark", validate_qualify_columns=True
        )
        typed = annotate_types(qualified, schema=schema, dialect="spark")
    except (OptimizeError, ParseError) as err:
        raise SpecError(f"{where}: {_first(err)} (or it is ambiguous)") from None
    assert isinstance(typed, exp.Query)
    return typed


def _schema(known: dict[str, Relation]) -> dict[str, object]:
    """The relations as sqlglot's schema: name -> column -> SQL type."""
    return {n: {c: _sqlglot_type(t) for c, t in r.columns} for n, r in known.items()}


def _sqlglot_type(column_type: str) -> str:
    """A column type as sqlglot's SQL type (``decimal(p,s)`` as ``DECIMAL(p,s)``)."""
    found = decimal_of(column_type)
    return f"DECIMAL({found[0]},{found[1]})" if found else _SQLGLOT_TYPES[column_type]


def _class(dtype: exp.DataType | None) -> str | None:
    """The declared-type family sqlglot inferred (None when it could not tell)."""
    from sqlglot import exp

    if dtype is None:
        return None
    families = (
        (exp.DataType.TEXT_TYPES, "string"),
        (exp.DataType.INTEGER_TYPES, "integer"),
        (exp.DataType.REAL_TYPES, "fractional"),
        ({exp.DataType.Type.BOOLEAN}, "boolean"),
        (exp.DataType.TEMPORAL_TYPES, "timestamp"),
    )
    return next((name for types, name in families if dtype.this in types), None)


def _sql_type(dtype: exp.DataType | None) -> str:
    return dtype.sql(dialect="spark") if dtype is not None else "an unknown type"


def _first(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def renamed(spec: TopicSpec, topic: str, **changes: Any) -> TopicSpec:
    """``spec`` for another topic name (its identifier derived from it unless ``changes`` set
    ``name``), its declared tables renamed with it (``orders_hourly`` of ``orders`` becomes
    ``<name>_hourly``) and their SQL reading the renamed relations; ``changes`` replace other
    fields. For tests and benchmarks that need a fresh topic."""
    from sqlglot import exp

    from backfill_assets.spec.model import identifier_of

    unknown = sorted(set(changes) - set(TopicSpec.model_fields))
    if unknown:
        raise TypeError(f"renamed(): TopicSpec has no field(s) {unknown}")
    old = spec.name
    ident = str(changes.pop("name", None) or identifier_of(topic))

    def new_name(name: str) -> str:
        return ident + name[len(old) :] if name.startswith(old) else f"{ident}__{name}"

    names = {old: ident, spec.current_table: f"{ident}_current"}
    names.update({t.name: new_name(t.name) for t in spec.tables})
    marks = {f"{{{p}}}": f"__window_{p}__" for p in WINDOW_PARAMS}

    def rewrite(sql: str) -> str:
        for param, mark in marks.items():
            sql = sql.replace(param, mark)
        query = _parse(sql, f"topic {spec.topic!r}")
        for node in query.find_all(exp.Table):
            if not node.db and node.name in names:
                node.set("this", exp.to_identifier(names[node.name]))
        out = query.sql(dialect="spark", pretty=True)
        for param, mark in marks.items():
            out = out.replace(mark, param)
        return out

    tables = tuple(
        t.model_copy(
            update={
                "name": names[t.name],
                "topic": topic,
                "sql": rewrite(t.sql),
                "source": names.get(t.source, t.source),
                "refs": tuple(names.get(r, r) for r in t.refs),
            }
        )
        for t in spec.tables
    )
    return spec.model_copy(update={"topic": topic, "name": ident, "tables": tables, **changes})
