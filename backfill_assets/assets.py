"""Assets generated from topics.yaml: one raw table per topic, written write-audit-publish."""

from collections.abc import Iterator
from typing import Any

import dagster as dg
from dagster import AssetExecutionContext

from backfill_assets import checks, replay
from backfill_assets.partitions import kafka_hours
from backfill_assets.resources import IcebergResource, KafkaResource, SparkResource
from backfill_assets.spec import TopicSpec

# One run covers up to a week of hourly partitions: a 30-day backfill starts 5 runs (5 Spark
# sessions and 5 branches), not 720. A week is also the retry unit: a failed run re-reads at
# most 168 hours. single_run() would make a month one all-or-nothing branch.
BACKFILL_POLICY = dg.BackfillPolicy.multi_run(max_partitions_per_run=168)


def raw_asset_key(spec: TopicSpec) -> dg.AssetKey:
    return dg.AssetKey(["raw", spec.topic])


def build_raw_asset(spec: TopicSpec) -> dg.AssetsDefinition:
    key = raw_asset_key(spec)

    @dg.asset(
        key=key,
        name=None,
        description=f"Kafka topic {spec.topic!r} replayed by exact offsets, one row per event.",
        partitions_def=kafka_hours(spec),
        backfill_policy=BACKFILL_POLICY,
        group_name="raw",
        kinds={"kafka", "spark", "iceberg"},
        pool="backfill",
        check_specs=[
            dg.AssetCheckSpec(name, asset=key, blocking=True) for name in checks.CHECK_NAMES
        ],
        metadata={"table": spec.raw_table, "quarantine_table": spec.quarantine_table},
    )
    def _raw(
        context: AssetExecutionContext,
        spark: SparkResource,
        kafka: KafkaResource,
        iceberg: IcebergResource,
    ) -> Iterator[Any]:
        window = context.partition_time_window
        session = spark.spark_session
        table = iceberg.spark_name(spec.raw_table)
        context.log.info(
            f"replaying {spec.topic} {window.start.isoformat()}..{window.end.isoformat()} "
            f"into branch of {table}"
        )
        outcome = replay.replay_to_branch(
            session,
            settings=kafka.settings,
            kafka=kafka,
            iceberg=iceberg,
            spec=spec,
            start=window.start,
            end=window.end,
            run_id=context.run.run_id,
        )
        results = checks.run_checks(session, spec, table, outcome)
        for result in results:
            yield dg.AssetCheckResult(
                check_name=result.name,
                passed=result.passed,
                description=result.summary,
                metadata=_meta(result.metadata),
            )
        failed = [r for r in results if not r.passed]
        if failed:
            raise dg.Failure(
                description=(
                    f"{len(failed)} blocking check(s) failed for {spec.topic} "
                    f"{window.start.isoformat()}..{window.end.isoformat()}: "
                    + "; ".join(f"{r.name}: {r.summary}" for r in failed)
                    + f". Main is unchanged; inspect branch {outcome.branch!r} of {table}."
                ),
                metadata={"branch": outcome.branch, "failed_checks": [r.name for r in failed]},
            )
        snapshot = replay.publish(session, table, outcome, {r.name: "passed" for r in results})
        rate = outcome.records_read / outcome.duration_s if outcome.duration_s else 0.0
        yield dg.MaterializeResult(
            metadata={
                "records_read": outcome.records_read,
                "rows_written": outcome.rows_written,
                "duplicates": outcome.duplicates,
                "quarantined": outcome.quarantined,
                "offsets": dg.MetadataValue.json(
                    {str(p): list(r) for p, r in outcome.contract.ranges.items()}
                ),
                "checksum": outcome.checksum,
                "drain_rate_records_per_s": round(rate, 1),
                "duration_s": round(outcome.duration_s, 2),
                "snapshot_id": str(snapshot),
                "main_snapshot_before": str(outcome.main_snapshot_before),
            }
        )

    return _raw


def _meta(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in values.items():
        out[k] = dg.MetadataValue.json(v) if isinstance(v, dict | list) else v
    return out
