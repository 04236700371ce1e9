"""Column lineage of declared tables, from the sqlglot parse of their SQL: per output column,
the (relation, column) pairs it is computed from; and the same as Dagster's
``dagster/column_lineage`` on the declared assets."""

from __future__ import annotations

import dagster as dg

from backfill_assets.defs.definitions import defs
from backfill_assets.spec import declared
from backfill_assets.spec.loader import load_specs

RAW = dg.AssetKey(["raw", "orders"])
HOURLY = dg.AssetKey(["lakehouse", "orders_hourly"])


def _lineage() -> dict[str, declared.ColumnLineage]:
    specs = load_specs()
    known = declared.relations(specs)
    return {t.name: declared.column_lineage(t, known) for s in specs for t in s.tables}


def test_aggregates_and_renames_trace_to_the_events_columns() -> None:
    hourly = _lineage()["orders_hourly"]
    assert set(hourly) == {
        "event_hour",
        "currency",
        "events",
        "orders",
        "amount_minor",
        "cancelled",
    }
    # CAST(sum(amount_minor) AS BIGINT) AS amount_minor
    assert hourly["amount_minor"] == (("orders", "amount_minor"),)
    # date_trunc('HOUR', event_time) AS event_hour
    assert hourly["event_hour"] == (("orders", "event_time"),)
    assert hourly["orders"] == (("orders", "order_id"),)  # count(DISTINCT order_id)
    assert hourly["cancelled"] == (("orders", "event_type"),)  # count_if(event_type = ...)
    assert hourly["events"] == ()  # count(*) reads no column


def test_aliased_relation_resolves_to_the_relation() -> None:
    large = _lineage()["orders_large_paid"]
    assert large["amount_minor"] == (("orders", "amount_minor"),)  # e.amount_minor, e = orders
    assert large["event_id"] == (("orders", "event_id"),)
    # status is only filtered on: it selects rows, it is no column's source.
    assert all(("orders", "status") not in pairs for pairs in large.values())


def test_ctes_joins_and_other_tables_are_followed() -> None:
    specs = load_specs()
    known = declared.relations(specs)
    table = (
        specs[0]
        .tables[0]
        .model_copy(
            update={
                "name": "orders_probe",
                "sql": (
                    "WITH w AS (SELECT order_id, amount_minor AS amt FROM orders "
                    "WHERE event_time >= {start} AND event_time < {end}) "
                    "SELECT w.order_id, sum(w.amt) + max(c.amount_minor) AS total, "
                    "max(h.events) AS most FROM w JOIN orders_current c ON c.order_id = w.order_id "
                    "CROSS JOIN orders_hourly h GROUP BY w.order_id"
                ),
            }
        )
    )
    lineage = declared.column_lineage(table, known)
    assert lineage["order_id"] == (("orders", "order_id"),)
    assert lineage["total"] == (("orders", "amount_minor"), ("orders_current", "amount_minor"))
    assert lineage["most"] == (("orders_hourly", "events"),)


def test_declared_assets_carry_dagster_column_lineage() -> None:
    lineage = defs.resolve_asset_graph().get(HOURLY).metadata["dagster/column_lineage"]
    assert isinstance(lineage, dg.TableColumnLineage)
    assert lineage.deps_by_column["amount_minor"] == [dg.TableColumnDep(RAW, "amount_minor")]
    assert lineage.deps_by_column["event_hour"] == [dg.TableColumnDep(RAW, "event_time")]
    assert lineage.deps_by_column["events"] == []
