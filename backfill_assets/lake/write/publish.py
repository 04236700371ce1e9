"""The publish protocol of every table: audit on the run's branch, publish, record.

:func:`publish` takes a run's branch and its blocking check results. It publishes only when
every check passed, by one atomic Iceberg commit that fast-forwards main to the audited branch
(:func:`backfill_assets.lake.write.wap.publish`). When main moved under the run through publishes of
disjoint windows, ``rebase(attempt)`` re-applies the run's rows on a new branch from main and
re-runs the checks, up to ``BACKFILL_PUBLISH_ATTEMPTS`` times; an overlapping publish is
refused, naming its run.

What is atomic: only the fast-forward. The audit row and the ledger rows are written after it;
a run killed in between leaves main published without them, and the next publish of the table
adds them from the snapshot summaries (``audit.record_unaudited_publishes``,
``ledger.sync_from_history``). Every outcome (published, checks failed, refused) is appended to
the audit table before this returns or raises.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from backfill_assets.errors import (
    ChecksFailed,
    MainMoved,
    NeighbourMoved,
    PublishError,
    PublishRefused,
    TopicReplaced,
)
from backfill_assets.lake.offsets import identity, ledger, windows
from backfill_assets.lake.write import audit, checks, derived, replay, wap
from backfill_assets.lake.write.checks import CheckOutcome
from backfill_assets.lake.write.replay import ReplayOutcome
from backfill_assets.spec.model import TopicSpec
from backfill_assets.stack.catalog import CatalogClient
from backfill_assets.stack.faults import failpoint
from backfill_assets.stack.kafka import KafkaClient, TopicIdentity

Rebase = Callable[[int], tuple[wap.Branch, list[CheckOutcome]]]


@dataclass
class PublishRequest:
    """One run's branch of ``table`` (a Spark identifier), its check results and what the audit
    and the ledger record of it."""

    table: str
    branch: wap.Branch
    results: list[CheckOutcome]
    window: tuple[datetime, datetime]
    # Columns of the audit row (run_id, backfill_id, launched_by, figures, ...).
    record: dict[str, Any]
    # Snapshot summary entries written with the publish.
    summary: dict[str, str]
    rebase: Rebase
    ledger_offsets: dict[datetime, dict[int, tuple[int, int]]] | None = None
    ledger_records: dict[datetime, int] | None = None
    ledger_event_hours: dict[datetime, dict[datetime, int]] | None = None
    # raw: per Kafka hour, the event hours of the other versions of its event ids (a
    # correction touches the hour of the version it supersedes)
    ledger_superseded_hours: dict[datetime, set[datetime]] | None = None
    # derived: the publish of each input the run read, (snapshot id, sequence number)
    ledger_reads: dict[str, tuple[int, int]] | None = None
    # raw: the topic and the log its windows were read from, checked again right before the
    # commit (a topic recreated meanwhile is refused) and recorded with the ledger rows
    topic: str | None = None
    identity: TopicIdentity | None = None
    # raw: the run's branch of the quarantine table, published right after the rows
    quarantine: wap.Branch | None = None


@dataclass
class Published:
    """Main's new snapshot, the table's total rows in it (if Iceberg's summary says), the check
    results of the audited branch and what was learnt after the commit."""

    snapshot_id: int
    total_records: int | None
    branch: wap.Branch
    results: list[CheckOutcome]
    recorded_late: list[str] = field(default_factory=list)
    history_error: str | None = None


def raw_request(
    session: Any, spec: TopicSpec, outcome: ReplayOutcome, results: list[CheckOutcome]
) -> PublishRequest:
    """What a raw run publishes: its branch and checks, the snapshot summary of its contract,
    and the ledger rows of its windows (offsets, records, and the event hours each Kafka hour
    held, which the late-data sensor reads instead of the rows). A rebase copies the run's
    rows to a new branch from main and checks them again. ``record`` (the audit row's run
    fields) is left to the caller."""
    contract = outcome.contract
    assert contract.windows is not None
    cells = contract.windows
    superseded: dict[datetime, set[datetime]] = {}

    def touched() -> None:
        """The event hours of other versions of the run's event ids, from the branch the
        publish would put on main (again after a rebase)."""
        superseded.clear()
        if _one_version_each(session, outcome):
            return
        superseded.update(
            derived.other_version_hours(
                session, spec, outcome.branch.ident, contract.start, contract.end
            )
        )

    def rebase(attempt: int) -> tuple[wap.Branch, list[CheckOutcome]]:
        outcome.branch = replay.reapply(session, outcome, attempt)
        results = checks.run_checks(session, spec, outcome)
        touched()
        return outcome.branch, results

    touched()

    return PublishRequest(
        table=outcome.branch.table,
        branch=outcome.branch,
        results=results,
        window=(contract.start, contract.end),
        record={"records_read": outcome.records_read, "rows_written": outcome.rows_written},
        summary={
            **replay.audit_summary(contract, outcome.run_id),
            "checksum": outcome.checksum,
        },
        rebase=rebase,
        ledger_offsets={h: cells.hour_offsets(h) for h in cells.hours},
        ledger_records={h: sum(c.records for c in cells.cells[h].values()) for h in cells.hours},
        ledger_event_hours={
            datetime.fromisoformat(h): {datetime.fromisoformat(e): n for e, n in late.items()}
            for h, late in outcome.event_hours.items()
        },
        ledger_superseded_hours=superseded,
        topic=spec.topic,
        identity=contract.identity,
        quarantine=outcome.quarantine_branch,
    )


def derived_request(
    session: Any,
    table: str,
    outcome: derived.DerivedOutcome,
    build: Callable[[int], derived.DerivedOutcome],
    run_id: str,
    window: tuple[datetime, datetime],
) -> PublishRequest:
    """What a derived run (current state or a declared table) publishes: its branch and
    checks, a summary naming the run, its window and which publish of each input it read. A
    rebase builds the window again on a new branch from main (``build(attempt)``, which reads
    the inputs again), drops the old branch, and records what the new build read. ``record``
    (the audit row's run fields) is left to the caller."""
    summary = {
        "run-id": run_id,
        "window": f"{window[0].isoformat()}/{window[1].isoformat()}",
        # Which publish of each input the run read (ledger.sync_from_history keeps it).
        "reads": ledger.reads_json(outcome.reads),
    }

    def rebase(attempt: int) -> tuple[wap.Branch, list[CheckOutcome]]:
        again = build(attempt)
        wap.drop_branch(table, outcome.branch.name)
        outcome.branch, outcome.checks, outcome.metadata = (
            again.branch,
            again.checks,
            again.metadata,
        )
        # The rebased run read its inputs again: its lineage is what it read this time.
        outcome.reads.clear()
        outcome.reads.update(again.reads)
        summary["reads"] = ledger.reads_json(outcome.reads)
        return again.branch, again.checks

    return PublishRequest(
        table=table,
        branch=outcome.branch,
        results=outcome.checks,
        window=window,
        record={},
        summary=summary,
        rebase=rebase,
        ledger_reads=outcome.reads,
    )


def _one_version_each(session: Any, outcome: ReplayOutcome) -> bool:
    """Whether no event id of the run's window can have another version on its branch.

    Two facts say so: the checks found no event id whose copies in the window differ
    (identical copies, a producer's resends, share their event hour), and the branch holds no
    row outside the window (its snapshot's ``total-records``, which never undercounts live
    rows, is the rows the checks counted in the window). A first ingest, or a rerun of every
    hour the table holds, then needs no read of the branch for
    :func:`derived.other_version_hours`: it is empty by definition."""
    if outcome.conflicting_ids:
        return False
    total = replay.branch_write_stats(session, outcome.branch).get("total-records")
    return total is not None and total == outcome.rows_written


def publish(
    tables: CatalogClient,
    session: Any,
    request: PublishRequest,
    *,
    on_retry: Callable[[str], None] = lambda _message: None,
) -> Published:
    """Publish ``request``'s branch if every check passed (rebasing on a moved main), then
    record it in the audit table and the ledger. Raises :class:`ChecksFailed` or
    :class:`PublishRefused` when nothing was published."""
    record = dict(request.record, snapshot_before=request.branch.main_before)
    branch, results, snapshot, error = _attempt(tables, session, request, record, on_retry)
    record["checks"] = audit.checks_json({r.name: r.passed for r in results})
    failed = [r for r in results if not r.passed]
    if failed:
        detail = "; ".join(f"{r.name}: {r.summary}" for r in failed)
        audit.record(tables, "check_failed", "failed", record, detail=detail)
        raise ChecksFailed(detail, branch, results)
    if error is not None or snapshot is None:
        error = error or PublishError("nothing was published")
        audit.record(tables, "publish_refused", "failed", record, detail=str(error))
        raise PublishRefused(error, branch, results)
    quarantine_error = _publish_quarantine(session, request)
    # A loss an operator accepted (checks.records_kept) is said in the publish's own row.
    accepted = [str(r.metadata["accepted_loss"]) for r in results if "accepted_loss" in r.metadata]
    audit.record(
        tables,
        "publish",
        "succeeded",
        {**record, "snapshot_after": snapshot},
        detail="; ".join(accepted) or None,
    )
    total = _record_publish(tables, request, snapshot)
    late, history_error = _record_history(tables, request.table, branch, record.get("run_id"))
    if quarantine_error is not None:
        history_error = "; ".join(e for e in (quarantine_error, history_error) if e)
    return Published(snapshot, total, branch, results, late, history_error)


def _publish_quarantine(session: Any, request: PublishRequest) -> str | None:
    """Publish the run's quarantine branch right after its rows; an error in words (the rows
    are published either way: the next run of the topic finishes it, replay.finish_quarantine)."""
    if request.quarantine is None:
        return None
    try:
        replay.publish_quarantine(session, request.quarantine, request.window, request.summary)
    except Exception as exc:
        run_id = request.summary.get("run-id", "")
        if run_id and replay.quarantine_finished(session, request.quarantine, run_id):
            return None  # another run of the topic, starting just now, published it for us
        return (
            f"the run's quarantine rows are not published yet ({exc}); the next run of the "
            "topic publishes them"
        )
    return None


def _attempt(
    tables: CatalogClient,
    session: Any,
    request: PublishRequest,
    record: dict[str, Any],
    on_retry: Callable[[str], None],
) -> tuple[wap.Branch, list[CheckOutcome], int | None, BaseException | None]:
    """The publish attempts: (audited branch, its checks, main's new snapshot, refusal)."""
    branch, results = request.branch, request.results
    attempts = tables.settings.publish_attempts
    for attempt in range(attempts):
        if any(not r.passed for r in results):
            return branch, results, None, None
        summary = {
            **request.summary,
            "checks": json.dumps({r.name: "passed" for r in results}, sort_keys=True),
        }
        failpoint("checks_passed")
        try:
            _check_identity(tables, request)
            _check_neighbours(tables, request)
            return branch, results, wap.publish(session, branch, summary, request.window), None
        except MainMoved as exc:
            if attempt + 1 >= attempts:
                refused = PublishError(
                    f"{exc}; gave up after {attempts} attempts (BACKFILL_PUBLISH_ATTEMPTS). "
                    f"Nothing was published; re-run the backfill."
                )
                return branch, results, None, refused
            on_retry(f"{exc} (attempt {attempt + 2} of {attempts})")
            branch, results = request.rebase(attempt + 1)
            record["snapshot_before"] = branch.main_before
        except (PublishError, TopicReplaced) as exc:
            return branch, results, None, exc
    return branch, results, None, None


def _check_identity(tables: CatalogClient, request: PublishRequest) -> None:
    """Right before each publish attempt: the log the run's windows were read from must still
    be Kafka's log of the topic and the ledger's (a topic deleted and recreated, or failed
    over, while the run ran raises
    :class:`~backfill_assets.errors.TopicReplaced`)."""
    if request.topic is None or request.identity is None:
        return
    identity.still_same(
        KafkaClient(tables.settings),
        tables.catalog(),
        tables.settings.catalog.namespace,
        request.topic,
        request.table,
        request.identity,
    )


def _check_neighbours(tables: CatalogClient, request: PublishRequest) -> None:
    """Right before each publish attempt (so also after a rebase): the run's windows, fixed
    when it started, must still chain on the published windows beside them. A neighbour that
    was published meanwhile fixed its own boundary (a producer's late clock can put an offset
    on either side); publishing anyway would lose that offset or count it twice, and break the
    chain for every later run. Publishes whose ledger rows a crash left out count too."""
    if not request.ledger_offsets:
        return
    cat, namespace = tables.catalog(), tables.settings.catalog.namespace
    ledger.sync_from_history(cat, namespace, request.table)
    problems = windows.neighbour_mismatches(
        request.ledger_offsets, ledger.published_offsets(cat, namespace, request.table)
    )
    if problems:
        start, end = request.window
        raise NeighbourMoved(
            f"{request.table} {start.isoformat()}..{end.isoformat()}: the run's offset windows "
            f"no longer fit the windows published beside them ({'; '.join(problems)}). "
            "Nothing was published; run the same hours again: a new run chains on the "
            "published windows (the gap sensor requests them by itself)."
        )


def _record_publish(tables: CatalogClient, request: PublishRequest, snapshot: int) -> int | None:
    """The ledger rows of the publish; returns the table's total rows from Iceberg's summary."""
    cat = tables.catalog()
    ident = request.table.split(".", 1)[1]
    seq = cat.load_table(ident).metadata.snapshot_by_id(snapshot)
    total = seq.summary.additional_properties.get("total-records") if seq and seq.summary else None
    ledger.record_publish(
        cat,
        tables.settings.catalog.namespace,
        request.table,
        run_id=str(request.record.get("run_id")),
        snapshot_id=snapshot,
        sequence_number=int(seq.sequence_number or 0) if seq is not None else 0,
        hours=windows.hours_between(*request.window),
        offsets=request.ledger_offsets,
        records=request.ledger_records,
        event_hours=request.ledger_event_hours,
        superseded_hours=request.ledger_superseded_hours,
        reads=request.ledger_reads,
        identity=request.identity,
    )
    return int(total) if total is not None else None


def _record_history(
    tables: CatalogClient, table: str, branch: wap.Branch, run_id: Any
) -> tuple[list[str], str | None]:
    """Audit and ledger rows for publishes of runs killed after their fast-forward (found in
    main's history since ``branch`` was made): (their run ids, an error if the look failed;
    main is published either way, so a failure here must not fail the run)."""
    cat, namespace = tables.catalog(), tables.settings.catalog.namespace
    try:
        late = audit.record_unaudited_publishes(
            cat, namespace, table, since=branch.main_before, recorded_by=run_id
        )
        late += ledger.sync_from_history(cat, namespace, table)
    except Exception as exc:
        return [], str(exc)
    return list(late), None
