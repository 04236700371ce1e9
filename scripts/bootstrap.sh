#!/usr/bin/env bash
# Install everything the project needs on a fresh machine, idempotently:
#   .venv with the Python packages of requirements.lock (re-installed when it or pyproject.toml
#   changes)
#   JVM jars from Maven Central into .stack/jars (re-resolved only when a pom changes), and the
#   local schema registry (Apicurio Registry, maven/schema-registry) built there once (~30-50 s)
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
# Packages come from requirements.lock (every version pinned and every file's sha256 checked;
# scripts/lock.sh makes it from pyproject.toml), then the project itself without dependencies.
stamp=.venv/.installed-lock.sha256
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing Python packages into .venv (requirements.lock)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q --require-hashes -r requirements.lock
  .venv/bin/python -m pip install -q --no-deps -e .
  .venv/bin/python -m pip check >/dev/null || {
    echo "bootstrap: requirements.lock does not satisfy pyproject.toml; run scripts/lock.sh" >&2
    .venv/bin/python -m pip check >&2
    exit 1
  }
  echo "$want" > "$stamp"
fi

.venv/bin/backfill-assets jars resolve
# The Spark driver's class-data-sharing archive (backfill_assets/stack/cds.py): built once per
# pyspark/JVM/jar set, about 45 s; without it Spark works, it only starts slower.
.venv/bin/backfill-assets jars cds || echo "bootstrap: no Spark CDS archive (see above); Spark will start slower" >&2
