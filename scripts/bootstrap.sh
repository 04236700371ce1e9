#!/usr/bin/env bash
# Install everything the project needs on a fresh machine, idempotently:
#   .venv with the pinned Python packages (re-installed only when pyproject.toml changes)
#   JVM jars from Maven Central into .stack/jars (re-resolved only when a pom changes)
#   the Spark driver's class-data-sharing archive in .stack/jars/cds (built once per jar set)
#   the project's JVM functions (backfill_assets/stack/java), compiled into .stack/jars/udf
# Needs: python3.11+, a JDK 17+ (java, javac) and Maven (mvn) on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

for tool in python3 java javac mvn; do
  command -v "$tool" >/dev/null || { echo "bootstrap: '$tool' is not on PATH (need Python 3.11+, a JDK 17+ with javac, Maven)" >&2; exit 1; }
done

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi

.venv/bin/backfill-assets jars resolve
# The Spark driver's class-data-sharing archive (backfill_assets/stack/cds.py): built once per
# pyspark/JVM/jar set, about 45 s; without it Spark works, it only starts slower.
.venv/bin/backfill-assets jars cds || echo "bootstrap: no Spark CDS archive (see above); Spark will start slower" >&2
