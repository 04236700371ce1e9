"""The project inside a team's own Dagster code location (docs/embedding.md).

Two public entries, one result: :func:`definitions` returns the Definitions of a spec (a
``topics.yaml`` anywhere) to ``dg.Definitions.merge`` with the team's own; the component
:class:`BackfillAssets` does the same from a ``defs.yaml`` in a ``dg`` project's defs folder
(``type: backfill_assets.defs.embed.BackfillAssets``). Either way the spec is validated when
the code location loads, and every asset, check, sensor, schedule and job is the same as in
the project's own code location (``defs/definitions.py``).
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from backfill_assets.defs.build import build_defs
from backfill_assets.spec.loader import load_specs


def definitions(spec: str | Path | None = None, *, executor: bool = False) -> dg.Definitions:
    """Assets, checks, sensors, schedules, jobs and resources (``kafka``, ``spark``,
    ``iceberg``) of the topics of ``spec`` (default: ``BACKFILL_SPEC``, else the package's).
    ``executor``: also set the project's run executor (``BACKFILL_RUN_EXECUTOR``); off by
    default, since a code location has one executor and the team's may already be set."""
    found = load_specs(None if spec is None else Path(spec).resolve())
    defs = build_defs(found)
    if executor:
        return defs
    return dg.Definitions(
        assets=defs.assets,
        asset_checks=defs.asset_checks,
        sensors=defs.sensors,
        schedules=defs.schedules,
        jobs=defs.jobs,
        resources=defs.resources,
    )


class BackfillAssets(dg.Component, dg.Model, dg.Resolvable):
    """Kafka topics replayed into Iceberg tables by exact offsets, with their current state,
    declared tables, blocking checks and sensors, from a spec file.

    ``spec``: the topics.yaml, relative to this defs.yaml's folder (default:
    ``BACKFILL_SPEC``, which the CLI reads too: set both to the same file).
    ``executor``: use the project's run executor for the whole code location."""

    spec: str | None = None
    executor: bool = False

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        path = None if self.spec is None else context.path / self.spec
        return definitions(path, executor=self.executor)
