"""Test-only failpoints: named places in the write-audit-publish path where a run can be made
to die by SIGKILL, to prove that a crash at any of them leaves main either untouched or fully
published, and that a re-run converges.

A failpoint does nothing unless ``BACKFILL_FAULT_POINT`` (read by
:mod:`backfill_assets.stack.settings`) names it. Then it sends SIGKILL: to the whole process group
when this process leads it (the fault tests start each run with its own session, so the Spark
JVM and its Python workers die in the same instant, as when a container or node dies), else to
this process alone. Nothing runs after it: no ``finally``, no ``atexit``, no audit row.

Never set ``BACKFILL_FAULT_POINT`` outside tests.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from backfill_assets.stack.settings import FAULT_POINTS, Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

POINTS = FAULT_POINTS


def failpoint(name: str) -> None:
    """SIGKILL this run here if ``BACKFILL_FAULT_POINT`` names ``name``; otherwise nothing."""
    if name not in POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(POINTS)}")
    if Settings.from_env().fault_point != name:
        return
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


# Test-only: mutations applied to what a run just wrote, before its checks read it. The
# mutation tests register one (in-process) to prove each check blocks the fault it exists to
# catch. Nothing registers one outside tests.
BranchMutation = Callable[["SparkSession", str, str, Any], None]
_BRANCH_MUTATIONS: list[BranchMutation] = []


def after_branch_write(
    spark: SparkSession, branch: str, quarantine_table: str, contract: Any
) -> None:
    """Apply the registered test mutations to ``branch`` (a Spark identifier); else nothing."""
    for mutate in list(_BRANCH_MUTATIONS):
        mutate(spark, branch, quarantine_table, contract)


@contextmanager
def branch_mutation(mutate: BranchMutation) -> Iterator[None]:
    """Register ``mutate`` for the runs started inside the ``with`` block (test-only)."""
    _BRANCH_MUTATIONS.append(mutate)
    try:
        yield
    finally:
        _BRANCH_MUTATIONS.remove(mutate)
