"""Assets generated from the spec: per topic a raw table, its current state and its declared
tables, each materialization written on a run branch, audited by blocking checks, then
published."""

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster import AssetExecutionContext

from backfill_assets.defs import topics
from backfill_assets.defs.archiver import archive_asset_key
from backfill_assets.defs.partitions import kafka_hours
from backfill_assets.defs.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.errors import (
    CheckResult,
    KafkaClientError,
    NotPublished,
    PublishRefused,
    RunBranch,
    TopicReplaced,
)
from backfill_assets.lake.decode.envelope import KAFKA_COLUMNS
from backfill_assets.lake.offsets.contract import window_contract
from backfill_assets.lake.write import audit, checks, derived, publish, replay
from backfill_assets.spec import declared, versions
from backfill_assets.spec.model import CURRENT_META_COLUMNS, ColumnSpec, TableSpec, TopicSpec
from backfill_assets.stack.catalog import CatalogClient, refusal
from backfill_assets.stack.settings import Settings


def backfill_policy(settings: Settings | None = None) -> dg.BackfillPolicy:
    """How a backfill's range is cut into runs: at most ``BACKFILL_MAX_HOURS_PER_RUN`` hourly
    partitions each (default 720: a 30-day backfill is one run, one Spark session, one branch
    per table; docs/how-it-works.md, "Backfill policy")."""
    hours = (settings or Settings.from_env()).max_hours_per_run
    return dg.BackfillPolicy.multi_run(max_partitions_per_run=hours)


POOL = "backfill"


def raw_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["raw", spec.name])


def quarantine_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["quarantine", spec.name])


def quarantine_asset(spec: TopicSpec) -> dg.AssetSpec:
    """The topic's quarantine table as an asset of its own: each raw publish records an
    observation of it with the window's quarantined records per reason (its rows are written
    and published by the raw asset's runs, so nothing materializes it alone; ``backfill-assets
    quarantine`` lists it all and re-runs its hours)."""
    return dg.AssetSpec(
        key=quarantine_asset_key(spec),
        description=(
            f"Records of Kafka topic {spec.topic!r} that could not become rows, with their "
            "offsets and a reason (published with the raw rows of the same run)."
        ),
        deps=[raw_asset_key(spec)],
        group_name="raw",
        kinds={"iceberg"},
        metadata={"dagster/table_name": table_name(spec.quarantine_table)},
    )


def table_asset_key(name: str) -> dg.AssetKey:
    """The asset of a declared table (or of a current-state table) by its table name."""
    return dg.AssetKey(["lakehouse", name])


def current_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return table_asset_key(spec.current_table)


def relation_asset_key(rel: declared.Relation) -> dg.AssetKey:
    """The asset a relation a declared table reads comes from."""
    if rel.kind == "events":
        return dg.AssetKey(["raw", rel.name])
    return table_asset_key(rel.name)


def _check_specs(
    key: dg.AssetKey, names: Sequence[str], descriptions: dict[str, str]
) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(name, asset=key, blocking=True, description=descriptions[name])
        for name in names
    ]


def _column(name: str, ctype: str, column: ColumnSpec | None = None) -> dg.TableColumn:
    other = []
    if column is not None:
        if column.allowed is not None:
            other.append(f"one of {', '.join(column.allowed)}")
        if column.min is not None:
            other.append(f">= {column.min:g}")
        if column.max is not None:
            other.append(f"<= {column.max:g}")
    nullable = column.nullable if column is not None else True
    return dg.TableColumn(
        name,
        ctype,
        constraints=dg.TableColumnConstraints(nullable=nullable, other=other),
    )


def column_schema(columns: Sequence[dg.TableColumn]) -> dict[str, Any]:
    """Definition metadata ``dagster/column_schema`` (the UI's Columns tab)."""
    return {"dagster/column_schema": dg.TableSchema(columns=list(columns))}


def table_name(table: str) -> str:
    """``<catalog>.<namespace>.<table>`` from the settings, as Spark SQL names it."""
    return CatalogClient().spark_name(table)


def raw_columns(spec: TopicSpec) -> list[dg.TableColumn]:
    """The raw table's columns, in table order: Kafka positions, the topic's, the run id."""
    return [
        *(_column(n, t) for n, t in KAFKA_COLUMNS),
        *(_column(c.name, c.type, c) for c in spec.columns),
        _column("ingest_run_id", "string"),
    ]


def current_columns(spec: TopicSpec) -> list[dg.TableColumn]:
    key = spec.current.key if spec.current is not None else spec.key_field
    key_type = next(c.type for c in spec.columns if c.name == key)
    return [
        _column(key, key_type),
        *(_column(c.name, c.type, c) for c in spec.columns if c.name != key),
        *(_column(n, t) for n, t in CURRENT_META_COLUMNS),
    ]


def _partition_figures(
    context: AssetExecutionContext, per_hour: dict[str, dict[str, int]], names: dict[str, str]
) -> None:
    """Give every partition of the run its own figures (never the run's totals), with its row
    count under ``dagster/partition_row_count``. ``names`` maps a figure to its metadata key;
    the one mapped to ``dagster/partition_row_count`` is the partition's rows. A partition
    without figures had nothing in its hour: zero."""
    measured = {f for figures in per_hour.values() for f in figures}
    names = {
        f: label
        for f, label in names.items()
        if f in measured or label == "dagster/partition_row_count"
    }
    partitions_def = context.assets_def.partitions_def
    assert isinstance(partitions_def, dg.TimeWindowPartitionsDefinition)
    for key in context.partition_keys:
        start = partitions_def.time_window_for_partition_key(key).start
        figures = per_hour.get(start.astimezone(UTC).isoformat(), {})
        context.add_asset_metadata(
            {label: int(figures.get(figure, 0)) for figure, label in names.items()},
            partition_key=key,
        )


Published = tuple[int, int | None, list[dg.AssetCheckResult]]


def _audit_and_publish(
    context: AssetExecutionContext,
    iceberg: IcebergResource,
    session: Any,
    request: publish.PublishRequest,
    figures: dict[str, Any],
) -> Generator[dg.AssetCheckResult, None, Published]:
    """:func:`backfill_assets.lake.write.publish.publish` in Dagster terms, with the run's own
    fields
    added to the audit record: on success nothing is yielded (the caller attaches the returned
    check results to the materialization they audited); when nothing was published, the check
    results are yielded and the run fails, naming the figures. Returns main's new snapshot id,
    the table's total rows and the check results."""
    window = context.partition_time_window
    tags = dict(context.run.tags)
    table = request.table
    request.record = {
        "table_name": table,
        "run_id": context.run.run_id,
        "backfill_id": tags.get("dagster/backfill"),
        "launched_by": audit.launched_by(tags),
        "window_start": window.start,
        "window_end": window.end,
        "offsets": request.summary.get("offsets"),
        "started_at": figures.pop("started_at", None),
        **request.record,
        **figures,
    }
    try:
        done = publish.publish(iceberg.client(), session, request, on_retry=context.log.info)
    except NotPublished as exc:
        # Nothing is published, so there is no materialization to attach them to: Dagster
        # records them against the partition's latest materialization, the data readers
        # still see (the run's own rows stay on the named branch).
        yield from _evaluations(exc.results, exc.branch)
        raise _audited(_failure(exc, table, window.start, window.end)) from None
    if done.recorded_late:
        context.log.warning(f"recorded unaudited publishes of runs {done.recorded_late} on {table}")
    if done.history_error is not None:
        context.log.warning(
            f"could not check {table}'s history for unaudited publishes: {done.history_error}"
        )
    return done.snapshot_id, done.total_records, _evaluations(done.results, done.branch)


def _evaluations(results: Sequence[CheckResult], branch: RunBranch) -> list[dg.AssetCheckResult]:
    return [
        dg.AssetCheckResult(
            check_name=result.name,
            passed=result.passed,
            description=result.summary,
            metadata={**_meta(result.metadata), "audited_branch": branch.name},
        )
        for result in results
    ]


def _failure(exc: NotPublished, table: str, start: datetime, end: datetime) -> BaseException:
    """What the run fails with when nothing was published."""
    if isinstance(exc, PublishRefused):
        if isinstance(exc.error, TopicReplaced):  # its message says it all
            return dg.Failure(description=str(exc.error))
        return exc.error
    failed = [r for r in exc.results if not r.passed]
    return dg.Failure(
        description=(
            f"{len(failed)} blocking check(s) failed for {table} {_span(start, end)}: {exc}. "
            f"Main is unchanged; inspect branch {exc.branch.name!r} "
            f"(SELECT * FROM {exc.branch.ident})."
        ),
        metadata={"branch": exc.branch.name, "failed_checks": [r.name for r in failed]},
    )


_AUDITED = "_backfill_assets_audited"


def _audited(exc: BaseException) -> BaseException:
    """Mark an exception whose failure is already in the audit table."""
    setattr(exc, _AUDITED, True)
    return exc


@contextmanager
def _audit_failures(
    context: AssetExecutionContext, iceberg: IcebergResource, table: str
) -> Iterator[None]:
    """Record any failure not yet audited (read, write or catalog errors), then re-raise it.

    If the audit table itself cannot be written, the original error still propagates.
    """
    try:
        yield
    except Exception as exc:
        if getattr(exc, _AUDITED, False):
            raise
        window = context.partition_time_window
        tags = dict(context.run.tags)
        first_line = (str(exc).strip().splitlines() or [""])[0][:500]
        try:
            audit.record(
                iceberg.client(),
                "run_failed",
                "failed",
                {
                    "table_name": table,
                    "run_id": context.run.run_id,
                    "backfill_id": tags.get("dagster/backfill"),
                    "launched_by": audit.launched_by(tags),
                    "window_start": window.start,
                    "window_end": window.end,
                },
                detail=f"{type(exc).__name__}: {first_line}",
            )
        except Exception as audit_exc:
            context.log.error(f"could not write the audit row for this failure: {audit_exc}")
        # Kafka said why, the topic is a new log, or the REST catalog refused our credentials
        # (pyiceberg or Spark's JVM): the message, no traceback
        if isinstance(exc, (KafkaClientError, TopicReplaced)):
            raise dg.Failure(description=str(exc)) from None
        refused = refusal(iceberg.settings.catalog, exc)
        if refused is not None:
            raise dg.Failure(description=str(refused)) from None
        raise


def _table_asset(
    spec: TopicSpec,
    key: dg.AssetKey,
    check_names: Sequence[str],
    descriptions: dict[str, str],
    **definition: Any,
) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """``dg.asset`` for table ``key`` written from ``spec``'s topic: partitioned by the topic's
    Kafka hours, backfilled by :func:`backfill_policy`, its runs in the :data:`POOL` pool, with
    the blocking checks ``check_names`` (described by ``descriptions``); ``definition`` holds
    the rest of the asset's arguments (description, group, deps, ...)."""
    decorator: Callable[[Callable[..., Any]], dg.AssetsDefinition] = dg.asset(
        key=key,
        partitions_def=kafka_hours(spec),
        backfill_policy=backfill_policy(),
        pool=POOL,
        check_specs=_check_specs(key, check_names, descriptions),
        **definition,
    )
    return decorator


def build_raw_asset(spec: TopicSpec) -> dg.AssetsDefinition:
    @_table_asset(
        spec,
        raw_asset_key(spec),
        checks.CHECK_NAMES,
        checks.DESCRIPTIONS,
        description=f"Kafka topic {spec.topic!r} replayed by exact offsets, one row per event.",
        group_name="raw",
        kinds={"kafka", "spark", "iceberg"},
        code_version=versions.raw_version(spec),
        # Read from Kafka, or from the archive for offsets Kafka no longer holds.
        deps=[topics.topic_asset_key(spec), archive_asset_key(spec)],
        metadata={
            "table": spec.raw_table,
            "quarantine_table": spec.quarantine_table,
            "dagster/table_name": table_name(spec.raw_table),
            "quarantine_table_name": table_name(spec.quarantine_table),
            **column_schema(raw_columns(spec)),
        },
    )
    def _raw(
        context: AssetExecutionContext,
        spark: SparkResource,
        kafka: KafkaResource,
        iceberg: IcebergResource,
    ) -> Iterator[Any]:
        table = iceberg.spark_name(spec.raw_table)
        with _audit_failures(context, iceberg, table):
            yield from _replay_raw(context, spark, kafka, iceberg, spec)

    return _raw


def _replay_raw(
    context: AssetExecutionContext,
    spark: SparkResource,
    kafka: KafkaResource,
    iceberg: IcebergResource,
    spec: TopicSpec,
) -> Iterator[Any]:
    window = context.partition_time_window
    started, began = datetime.now(UTC), time.monotonic()
    table = iceberg.spark_name(spec.raw_table)
    context.log.info(f"replaying {spec.topic} {_span(window.start, window.end)} into {table}")
    context.log_event(topics.observation(kafka, spec))
    client, tables = kafka.client(), iceberg.client()
    # Kafka and the ledger first: the Spark session is still starting (SparkResource).
    contract = window_contract(
        settings=client.settings,
        kafka=client,
        iceberg=tables,
        spec=spec,
        start=window.start,
        end=window.end,
    )
    session = spark.spark_session
    try:
        outcome = replay.replay_to_branch(
            session,
            contract,
            settings=client.settings,
            iceberg=tables,
            spec=spec,
            run_id=context.run.run_id,
            began=began,
        )
        # Only an operator's run carries the tag (CLI --accept-fewer-records); sensors never do.
        outcome.accept_fewer_records = accepts_fewer_records(context.run.tags)
        results = checks.run_checks(session, spec, outcome)
    finally:
        if contract.windows is not None:
            contract.windows.cancel_decode()  # a failed run's decode stops reading
    request = publish.raw_request(session, spec, outcome, results)
    snapshot, total_rows, evaluations = yield from _audit_and_publish(
        context, iceberg, session, request, {"started_at": started}
    )
    accepted = _accepted_loss(evaluations)
    if accepted:
        context.log.warning(f"published with fewer records than the ledger counted: {accepted}")
    _partition_figures(
        context,
        outcome.per_hour,
        {
            "read": "records_read",
            "written": "dagster/partition_row_count",
            "quarantined": "quarantined",
        },
    )
    context.log_event(
        dg.AssetObservation(
            asset_key=quarantine_asset_key(spec),
            description=f"quarantined records of {_span(window.start, window.end)}",
            metadata={
                "hours": _span(window.start, window.end),
                "quarantined": outcome.quarantined,
                "reasons": dg.MetadataValue.json(outcome.quarantine_reasons),
                "list": f"backfill-assets quarantine --topic {spec.topic}",
            },
        )
    )
    yield dg.MaterializeResult(
        metadata=_raw_metadata(
            outcome, len(context.partition_keys), snapshot, total_rows, accepted
        ),
        check_results=evaluations,
    )


def _raw_metadata(
    outcome: replay.ReplayOutcome,
    partitions: int,
    snapshot: int,
    total_rows: int | None,
    accepted: str | None,
) -> dict[str, Any]:
    """A raw materialization's metadata."""
    rate = outcome.records_read / outcome.duration_s if outcome.duration_s else 0.0
    # Dagster repeats this metadata on every partition's materialization, so it holds only what
    # does not grow with the run's hours: run totals as one JSON value (the UI does not plot it
    # per partition). Each hour's figures are its own partition's (``_partition_figures``) and,
    # for the whole run, count_reconciliation's ``per_hour``: a map of every hour here made a
    # month's run store 672 x 672 hours (about 10 s of serializing on SQLite).
    return {
        "run": dg.MetadataValue.json(
            {
                "partitions": partitions,
                "records_read": outcome.records_read,
                "rows_written": outcome.rows_written,
                "quarantined": outcome.quarantined,
                "resent_event_ids": outcome.resent,
                "conflicting_event_ids": outcome.conflicting_ids,
                "bytes_read": outcome.bytes_read,
                "bytes_written": outcome.bytes_written,
                "files_written": outcome.files_written,
                "drain_rate_records_per_s": round(rate, 1),
                "duration_s": round(outcome.duration_s, 2),
            }
        ),
        "offsets": dg.MetadataValue.json(
            {str(p): list(r) for p, r in outcome.contract.ranges.items()}
        ),
        "checksum": outcome.checksum,
        "snapshot_id": str(snapshot),
        "main_snapshot_before": str(outcome.branch.main_before),
        "branch": outcome.branch.name,
        **_table_rows(total_rows),
        **({"accepted_record_loss": accepted} if accepted else {}),
    }


def accepts_fewer_records(tags: Mapping[str, str]) -> bool:
    """Whether a run's tags accept publishing fewer records than the ledger counted."""
    value = tags.get(checks.ACCEPT_FEWER_RECORDS_TAG, "")
    return value.strip().lower() in ("true", "1", "yes")


def _accepted_loss(evaluations: list[dg.AssetCheckResult]) -> str | None:
    """The loss an operator accepted for this run (checks.records_kept), in words."""
    for e in evaluations:
        value = (e.metadata or {}).get("accepted_loss")
        if value is not None:
            return str(getattr(value, "value", value))
    return None


def _table_rows(total: int | None) -> dict[str, Any]:
    """``dagster/row_count``: the whole table's rows on main after this publish."""
    return {"dagster/row_count": total} if total is not None else {}


def table_deps(table: TableSpec, known: dict[str, declared.Relation]) -> list[dg.AssetDep]:
    """What a declared table reads, with the partition mapping of each: event-time hour H reads
    Kafka hours H - lookback .. H + lateness of a topic (its events or current state), and
    hours H - lookback .. H of another declared table."""
    deps = []
    for ref in table.refs:
        rel = known[ref]
        later = table.lateness_hours if rel.kind != "table" else 0
        mapping = dg.TimeWindowPartitionMapping(
            start_offset=-table.lookback_hours, end_offset=later
        )
        deps.append(dg.AssetDep(relation_asset_key(rel), partition_mapping=mapping))
    return deps


def column_lineage(table: TableSpec, known: dict[str, declared.Relation]) -> dict[str, Any]:
    """Definition metadata ``dagster/column_lineage``: per output column, the columns of the
    assets it is computed from (:func:`backfill_assets.spec.declared.column_lineage`)."""
    deps = {
        column: [dg.TableColumnDep(relation_asset_key(known[rel]), name) for rel, name in pairs]
        for column, pairs in declared.column_lineage(table, known).items()
    }
    return {"dagster/column_lineage": dg.TableColumnLineage(deps_by_column=deps)}


def build_declared_asset(
    spec: TopicSpec, table: TableSpec, specs: Sequence[TopicSpec]
) -> dg.AssetsDefinition:
    known = declared.relations(list(specs))
    by_topic = {s.topic: s for s in specs}
    lineage = column_lineage(table, known)

    @_table_asset(
        spec,
        table_asset_key(table.name),
        derived.declared_checks(table),
        derived.DESCRIPTIONS,
        description=(table.description or f"Declared table {table.name} ({spec.topic}).")
        + f" SQL: {table.sql_origin}.",
        group_name="lakehouse",
        kinds={"spark", "iceberg"},
        code_version=versions.declared_version(table),
        deps=table_deps(table, known),
        metadata={
            "table": table.name,
            "dagster/table_name": table_name(table.name),
            "partitioned_by": f"event time ({table.event_time})",
            "grain": ", ".join(table.grain),
            "sql": dg.MetadataValue.md(f"```sql\n{table.sql.strip()}\n```"),
            **column_schema([_column(c.name, c.type, c) for c in table.columns]),
            **lineage,
        },
    )
    def _declared(
        context: AssetExecutionContext, spark: SparkResource, iceberg: IcebergResource
    ) -> Iterator[Any]:
        def build(attempt: int) -> derived.DerivedOutcome:
            window = context.partition_time_window
            return derived.build_declared(
                spark.spark_session,
                table,
                derived.Sources(by_topic, iceberg.spark_name),
                window.start,
                window.end,
                context.run.run_id,
                attempt,
            )

        yield from _derive(context, spark, iceberg, iceberg.spark_name(table.name), build, lineage)

    return _declared


def build_current_asset(spec: TopicSpec) -> dg.AssetsDefinition:
    @_table_asset(
        spec,
        current_asset_key(spec),
        derived.CURRENT_CHECKS,
        derived.DESCRIPTIONS,
        description=f"Latest state per {spec.key_field} ({spec.topic}); tombstones mark deletes.",
        group_name="lakehouse",
        kinds={"spark", "iceberg"},
        code_version=versions.current_version(spec),
        deps=[raw_asset_key(spec)],
        metadata={
            "table": derived.current_table(spec),
            "dagster/table_name": table_name(derived.current_table(spec)),
            "partitioned_by": "Kafka time",
            **column_schema(current_columns(spec)),
        },
    )
    def _current(
        context: AssetExecutionContext, spark: SparkResource, iceberg: IcebergResource
    ) -> Iterator[Any]:
        table = iceberg.spark_name(spec.current_table)

        def build(attempt: int) -> derived.DerivedOutcome:
            window = context.partition_time_window
            return derived.build_current(
                spark.spark_session,
                spec,
                iceberg.spark_name(spec.raw_table),
                table,
                window.start,
                window.end,
                context.run.run_id,
                attempt,
            )

        yield from _derive(context, spark, iceberg, table, build)

    return _current


def _derive(
    context: AssetExecutionContext,
    spark: SparkResource,
    iceberg: IcebergResource,
    table: str,
    run: Callable[[int], derived.DerivedOutcome],
    metadata: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """``metadata``: definition metadata each materialization repeats (the UI reads column
    lineage from the latest materialization)."""
    with _audit_failures(context, iceberg, table):
        yield from _derive_body(context, spark, iceberg, table, run, metadata or {})


def _derive_body(
    context: AssetExecutionContext,
    spark: SparkResource,
    iceberg: IcebergResource,
    table: str,
    run: Callable[[int], derived.DerivedOutcome],
    metadata: dict[str, Any],
) -> Iterator[Any]:
    window = context.partition_time_window
    started = datetime.now(UTC)
    session = spark.spark_session
    outcome = run(0)
    request = publish.derived_request(
        session, table, outcome, run, context.run.run_id, (window.start, window.end)
    )
    snapshot, total_rows, evaluations = yield from _audit_and_publish(
        context, iceberg, session, request, {"started_at": started}
    )
    _partition_figures(
        context,
        outcome.per_hour,
        {"rows": "dagster/partition_row_count", "raw_records": "raw_records"},
    )
    yield dg.MaterializeResult(
        metadata={
            "run": dg.MetadataValue.json(outcome.metadata),
            "snapshot_id": str(snapshot),
            **_table_rows(total_rows),
            **metadata,
        },
        check_results=evaluations,
    )


def build_topic_assets(
    spec: TopicSpec, specs: Sequence[TopicSpec] | None = None
) -> list[dg.AssetsDefinition]:
    """Everything one spec entry produces; ``specs`` (all topics) resolve what its declared
    tables read from other topics."""
    every = list(specs) if specs is not None else [spec]
    return [
        build_raw_asset(spec),
        build_current_asset(spec),
        *(build_declared_asset(spec, table, every) for table in spec.tables),
    ]


def _span(start: datetime, end: datetime) -> str:
    return f"{start.isoformat()}..{end.isoformat()}"


def _meta(values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        out[k] = dg.MetadataValue.json(v) if isinstance(v, dict | list) else v
    return out
