#!/usr/bin/env bash
# The README's demo command: install, start the local stack, write demo history, run a first
# backfill, then serve the Dagster UI (webserver + daemon) on 127.0.0.1:3000 until Ctrl-C.
# Safe to run again: every step skips work that is already done. One Ctrl-C (or SIGTERM) stops
# everything the demo serves, runs included, within 30 s; the Kafka broker and the Spark Connect
# server keep running (`backfill-assets stack down` stops them). State lives under $BACKFILL_HOME (default .stack).
set -euo pipefail

# A signal ignored when bash starts can be neither trapped nor reset, and stays ignored in every
# child: `bash scripts/demo.sh &` from a shell without job control starts with SIGINT ignored,
# and Dagster maps SIGTERM onto SIGINT's disposition, so nothing but SIGKILL stopped the demo
# (issue 14). Start again once with both back to their defaults.
if [ -n "$(trap -p INT TERM)" ] && [ -z "${_DEMO_SIGNALS_RESET:-}" ]; then
  export _DEMO_SIGNALS_RESET=1
  exec python3 -c 'import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' bash "$0" "$@"
fi
unset _DEMO_SIGNALS_RESET

cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
home="${BACKFILL_HOME:-$PWD/.stack}"  # as backfill_assets/stack/settings.py defaults it
export DAGSTER_HOME="${DAGSTER_HOME:-$PWD}"
export BACKFILL_DAGSTER_STORAGE="${BACKFILL_DAGSTER_STORAGE:-$home/dagster}"
mkdir -p "$BACKFILL_DAGSTER_STORAGE"
cli=.venv/bin/backfill-assets
hours="${DEMO_HOURS:-48}"
truth="$home/demo/orders.ground-truth.json"

$cli stack up
# Runs (the first backfill below, and every run the daemon launches) are thin clients of the
# warm Spark Connect server `stack up` started: no run starts a JVM of its own.
export BACKFILL_SPARK_CONNECT="${BACKFILL_SPARK_CONNECT:-sc://127.0.0.1:${BACKFILL_SPARK_CONNECT_PORT:-15002}}"
$cli catalog init
if [ ! -f "$truth" ]; then
  $cli generate --topic orders --hours "$hours" --events-per-hour "${DEMO_RATE:-600}"
else
  echo "demo history already written ($truth)"
fi
# The shipped spec's partitions start months before the demo's data; the demo serves a copy
# whose partition_start is the data's first hour, so the UI's partition bars hold the demo's
# hours only. Every process below (the first backfill, the UI, the daemon, their runs) reads it.
# A spec of your own (BACKFILL_SPEC set) is used as it is.
if [ -z "${BACKFILL_SPEC:-}" ]; then
  export BACKFILL_SPEC="$home/demo/spec/topics.yaml"
  .venv/bin/python - "$truth" "$BACKFILL_SPEC" <<'EOF'
import json, re, shutil, sys
from datetime import datetime
from pathlib import Path
from backfill_assets.spec.model import SPEC_PATH
start = datetime.fromisoformat(json.load(open(sys.argv[1]))["start"])
first = start.replace(minute=0, second=0, microsecond=0)
out = Path(sys.argv[2])
shutil.copytree(SPEC_PATH.parent / "tables", out.parent / "tables", dirs_exist_ok=True)
line = f'partition_start: "{first.isoformat()}"'
text, n = re.subn(r'partition_start: "[^"]*"', line, SPEC_PATH.read_text())
assert n == 1, f"{SPEC_PATH}: expected one partition_start, found {n}"
out.write_text(text)
EOF
  echo "demo spec: $BACKFILL_SPEC (partitions from the demo's first hour)"
fi
# First backfill: the first 6 hours of the demo history (raw + current state; the event-time
# table for the hours whose late events have all arrived). Skipped once it has succeeded.
if [ ! -f "$home/demo/first-backfill.done" ]; then
  span=$(.venv/bin/python - "$truth" "$hours" <<'EOF'
import json, sys
from datetime import datetime, timedelta
start = datetime.fromisoformat(json.load(open(sys.argv[1]))["start"])
print(start.isoformat(), (start + timedelta(hours=min(6, int(sys.argv[2])))).isoformat())
EOF
  )
  read -r start end <<<"$span"
  $cli materialize --topic orders --start "$start" --end "$end"
  touch "$home/demo/first-backfill.done"
fi
# Archive what Kafka holds (only records not archived yet; a no-op when nothing is new), so
# the history stays replayable after Kafka's retention deletes it.
$cli archive --topic orders
# Mark every hour with nothing to hold as done now (the gap sensor would report them a share per
# tick), so the UI's "Missing" means, from its first page, only hours whose records are not
# published yet.
$cli report-empty --topic orders

# Serve the UI. `dg dev` runs the webserver, the daemon and a code server; runs are subprocesses
# of the code server, Spark JVMs subprocesses of runs. All of them stay in one process group,
# which `dg dev` leads (setpgid below) and which is not this script's: a terminal's Ctrl-C
# reaches only this script, whose trap sends SIGINT to that whole group once (Dagster's own
# clean shutdown; runs are interrupted), waits up to 20 s, then SIGKILLs what is left of the
# group (Dagster alone may wait 60 s for a service and 30 s for a busy code server). The group
# survives its leader, so nothing that was orphaned escapes it. The broker runs in a session of
# its own (`stack up` detaches it), so neither signal reaches it. Bash starts background
# commands with SIGINT ignored: the launcher restores the default before it becomes `dg dev`.
port="${BACKFILL_WEBSERVER_PORT:-3000}"
shutdown() {  # $1: the exit status
  trap '' INT TERM HUP  # also ignored by `sleep` below, so a second Ctrl-C cannot cut this short
  set +e
  kill -INT -- "-$dev" 2>/dev/null || kill -INT "$dev" 2>/dev/null
  for _ in $(seq 100); do
    kill -0 -- "-$dev" 2>/dev/null || exit "$1"
    sleep 0.2
  done
  echo "demo: Dagster did not stop within 20 s; killing what is left of it" >&2
  kill -KILL -- "-$dev" 2>/dev/null
  exit "$1"
}
trap 'shutdown 130' INT
trap 'shutdown 143' TERM
trap 'shutdown 129' HUP
echo "Dagster UI: http://127.0.0.1:$port  (Ctrl-C stops it; the broker keeps running: '$cli stack down' stops it)"
.venv/bin/python -c 'import os, signal, sys
os.setpgid(0, 0)
for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])' .venv/bin/dg dev -w workspace.yaml -h 127.0.0.1 -p "$port" </dev/null &
dev=$!
status=0
wait "$dev" || status=$?
shutdown "$status"  # `dg dev` ended by itself: stop what it leaves behind
