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

What is atomic is unchanged: each ``store_event`` is Dagster's transactions, one per database.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.schedules.sqlite.sqlite_schedule_storage import (
    SqliteScheduleStorage,
)
from dagster._core.storage.sql import create_engine
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

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: dict[str, Any]
    ) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)
