"""The local default's Dagster storage: Dagster's SQLite storage, each database's engine kept.

Dagster's SQLite run, event-log and schedule storages build a new SQLAlchemy engine for every
connection they open. An engine holds SQLAlchemy's cache of compiled statements, so every
statement is compiled again each time: a run of a month of hourly partitions stores one
materialization per partition (and one planned event per partition when the run is created),
each of them several statements over two databases, and compiling them was about half of what
each event cost (``bench/partition_events.py --storage``).

:class:`SqliteStorage` is ``storage: sqlite:`` with one change: an engine per database file,
kept for the process (at most :data:`MAX_ENGINES`, least recently used dropped). The engines
use ``NullPool``, as Dagster's do, so each connection is still opened and closed around its
transaction; what is kept is the compiled statements, never a connection or a lock. The files,
their layout, journal mode, busy timeouts and transactions are Dagster's own: an instance
directory written by either storage is read by the other. Production uses Postgres
(infra/production/dagster.yaml), which keeps its engine already.

:meth:`EventLogStorage.store_event_batch` writes a batch of asset events (a ranged run's
materializations of one asset, a new run's planned events) in one transaction per database,
where Dagster's SQLite storage commits each event alone (two commits an event). What is atomic:
a batch's rows in the cross-run index, which is what the backfill daemon reads to decide which
child partitions may run. Stored one by one, a month's 672 materializations took seconds to
commit, and a daemon pass in between launched the declared tables' run for the hours it had
seen and a second run for the rest (dagster-io/dagster#19625). Dagster batches only when
``DAGSTER_EVENT_BATCH_SIZE`` is set; :class:`SqliteStorage` sets it to :data:`EVENT_BATCH_SIZE`
in its process unless the environment gives a value (``0`` turns batching off).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from dagster import EventLogEntry
from dagster._core.errors import DagsterInvariantViolationError
from dagster._core.events import ASSET_EVENTS
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.schedules.sqlite.sqlite_schedule_storage import (
    SqliteScheduleStorage,
)
from dagster._core.storage.sql import create_engine
from dagster._core.storage.sqlalchemy_compat import db_result
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from dagster._serdes import ConfigurableClassData
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

# Engines kept per process: one per run's event-log file touched, the index, runs and
# schedules. A daemon or webserver reads many runs' files over its life; the oldest go.
MAX_ENGINES = 64

# Dagster's DAGSTER_EVENT_BATCH_SIZE for processes on this storage, as production sets it for
# Postgres (infra/production): more than a run's hours (BACKFILL_MAX_HOURS_PER_RUN, 720).
EVENT_BATCH_SIZE = 1000

_engines: OrderedDict[tuple[str, float | None], Engine] = OrderedDict()
_engines_lock = threading.Lock()


def engine_for(url: str, timeout_s: float | None = None) -> Engine:
    """The process's engine for the SQLite database at ``url`` (made on first use, with
    ``NullPool`` and, when given, the sqlite3 busy timeout ``timeout_s``)."""
    key = (url, timeout_s)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is not None:
            _engines.move_to_end(key)
            return engine
        args: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
        engine = create_engine(url, poolclass=NullPool, connect_args=args)
        _engines[key] = engine
        while len(_engines) > MAX_ENGINES:
            _, old = _engines.popitem(last=False)
            old.dispose()  # NullPool: no connection is held, nothing in use is closed
        return engine


@contextmanager
def _transaction(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn, conn.begin():
        yield conn


class EventLogStorage(SqliteEventLogStorage):
    """Dagster's SQLite event log, its engines kept (:func:`engine_for`)."""

    @contextmanager
    def _connect(self, shard: str) -> Iterator[Connection]:
        with self._db_lock:
            engine = engine_for(self.conn_string_for_shard(shard), SQLITE_BUSY_TIMEOUT_SECONDS)
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            with _transaction(engine) as conn:
                yield conn

    def store_event_batch(self, events: Sequence[EventLogEntry]) -> None:
        """Store ``events`` in their order: each run of consecutive asset events of one Dagster
        run in one transaction per database (:meth:`_store_asset_events`), anything else as
        :meth:`store_event` does."""
        start = 0
        while start < len(events):
            end = start + 1
            if _asset_event(events[start]):
                run_id = events[start].run_id
                while end < len(events) and _asset_event(events[end], run_id):
                    end += 1
            if end - start == 1:
                self.store_event(events[start])
            else:
                self._store_asset_events(events[start:end])
            start = end

    def _store_asset_events(self, events: Sequence[EventLogEntry]) -> None:
        """:meth:`store_event` of asset events of one run, one transaction per database: the
        run's shard first, then the index (the rows, their tags, the assets' latest events).

        If the index's transaction fails, nothing of it is kept and each event's index rows
        are written alone (as :meth:`store_event` does) rather than raising: Dagster answers a
        failed batch by storing every event again, which would repeat the shard's rows. Only
        if one of those fails too does it raise (Dagster's own two-database write has the same
        gap between its shard and its index)."""
        statements = [self.prepare_insert_event(event) for event in events]
        with self.run_connection(events[0].run_id) as conn:
            for statement in statements:
                conn.execute(statement)
        try:
            with self.index_transaction() as conn:
                self._index_asset_events(conn, events, statements)
        except Exception:  # any failure: the rolled-back rows are written alone
            for event, statement in zip(events, statements, strict=True):
                with self.index_transaction() as conn:
                    self._index_asset_events(conn, [event], [statement])

    def _index_asset_events(
        self, conn: Connection, events: Sequence[EventLogEntry], statements: Sequence[Any]
    ) -> None:
        ids = []
        for statement in statements:
            with db_result(conn, statement) as result:
                ids.append(result.inserted_primary_key[0])
        if any(event_id is None for event_id in ids):
            raise DagsterInvariantViolationError("Cannot store asset event tags for null event id.")
        self._store_asset_event_tags(conn, events, ids)
        for event, event_id in zip(events, ids, strict=True):
            self._store_asset_event(conn, event, event_id)


def _asset_event(event: EventLogEntry, run_id: str | None = None) -> bool:
    """Whether ``event`` is an asset event (indexed as one) of ``run_id`` (when given)."""
    return (
        event.is_dagster_event
        and event.dagster_event_type in ASSET_EVENTS
        and (run_id is None or event.run_id == run_id)
    )


class RunStorage(SqliteRunStorage):
    """Dagster's SQLite run storage, its engine kept (:func:`engine_for`)."""

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        with _transaction(engine_for(self._conn_string)) as conn:
            yield conn


class ScheduleStorage(SqliteScheduleStorage):
    """Dagster's SQLite schedule storage, its engine kept (:func:`engine_for`)."""

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        with _transaction(engine_for(self._conn_string)) as conn:
            yield conn


class SqliteStorage(DagsterSqliteStorage):
    """``storage: sqlite:`` with the storages above, in the same files under ``base_dir``.

    dagster.yaml names it as ``storage: custom:`` with ``base_dir`` as its one setting."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        # DagsterSqliteStorage.__init__ with the storages above (its own would open Dagster's).
        self.base_dir = base_dir
        self._run_storage = RunStorage.from_local(_runs_directory(base_dir))
        self._event_log_storage = EventLogStorage(_event_logs_directory(base_dir))
        self._schedule_storage = ScheduleStorage.from_local(_schedule_directory(base_dir))
        self._inst_data = inst_data
        super(DagsterSqliteStorage, self).__init__()  # type: ignore[no-untyped-call]
        # Dagster reads it at each event; the process's own value (0: off) stays.
        os.environ.setdefault("DAGSTER_EVENT_BATCH_SIZE", str(EVENT_BATCH_SIZE))

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: dict[str, Any]
    ) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)
