"""An asset the team already had: it knows nothing of Kafka or Iceberg."""

import dagster as dg


@dg.asset(group_name="team", description="The team's own asset, beside the lakehouse tables.")
def team_report() -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"rows": 0})
