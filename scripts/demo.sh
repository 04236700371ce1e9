#!/usr/bin/env bash
# The README's demo command: install, start the local stack, write demo history, run a first
# backfill, then serve the Dagster UI (webserver + daemon) on 127.0.0.1:3000 until Ctrl-C.
# Safe to run again: every step skips work that is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export DAGSTER_HOME="$PWD" BACKFILL_DAGSTER_STORAGE="${BACKFILL_DAGSTER_STORAGE:-$PWD/.stack/dagster}"
mkdir -p "$BACKFILL_DAGSTER_STORAGE"
cli=.venv/bin/backfill-assets

$cli stack up
$cli catalog init
if [ ! -f .stack/demo/orders.ground-truth.json ]; then
  $cli generate --topic orders --hours "${DEMO_HOURS:-48}" --events-per-hour "${DEMO_RATE:-600}"
else
  echo "demo history already written (.stack/demo/orders.ground-truth.json)"
fi
# First backfill: the first 6 hours of the demo history (raw + current state; the event-time
# table for the hours whose late events have all arrived). Skipped once it has succeeded.
if [ ! -f .stack/demo/first-backfill.done ]; then
  start=$(.venv/bin/python -c "import json; print(json.load(open('.stack/demo/orders.ground-truth.json'))['start'])")
  end=$(.venv/bin/python -c "from datetime import datetime, timedelta; print((datetime.fromisoformat('$start') + timedelta(hours=6)).isoformat())")
  $cli materialize --topic orders --start "$start" --end "$end"
  touch .stack/demo/first-backfill.done
fi
# Archive what Kafka holds (only records not archived yet; a no-op when nothing is new), so
# the history stays replayable after Kafka's retention deletes it.
$cli archive --topic orders

echo "Dagster UI: http://127.0.0.1:${BACKFILL_WEBSERVER_PORT:-3000}  (Ctrl-C stops it; the broker keeps running: '$cli stack down' stops it)"
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${BACKFILL_WEBSERVER_PORT:-3000}"
