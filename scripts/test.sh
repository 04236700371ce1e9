#!/usr/bin/env bash
# The project's test command (README; CI runs it through .ci/run):
# install, lint, type-check, validate the Dagster definitions, then pytest.
# The default tier uses the real Kafka broker, Spark and Iceberg catalog. Marked tiers
# (faults, browser, slow, convergence, cluster, cdc) run after it when BACKFILL_TEST_TIERS lists them (CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The Dagster storage as scripts/demo.sh and the CLI default it (under BACKFILL_HOME, else .stack).
export DAGSTER_HOME="$PWD"
export BACKFILL_DAGSTER_STORAGE="${BACKFILL_DAGSTER_STORAGE:-${BACKFILL_HOME:-$PWD/.stack}/dagster}"

echo "== ruff"; .venv/bin/ruff check . && .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
# --no-check-yaml: the project has no component YAML (defs.yaml) to schema-check.
echo "== dg check defs"; VIRTUAL_ENV="$PWD/.venv" .venv/bin/dg check defs --no-check-yaml
# Marked tiers that no test carries yet are announced now, so that the last lines printed are
# always the summary of a pytest run that executed tests. A tier is carried when a test module
# names its marker (`pytest.mark.TIER`, or `pytestmark = pytest.mark.TIER`): read from the
# sources, not by a pytest collection per tier (about 7 s each). A marker named but
# deselected everywhere would still run pytest, which then says "no tests ran" and fails.
tiers=""
for tier in ${BACKFILL_TEST_TIERS:-}; do
  if grep -rqE "mark\.$tier\b" backfill_assets_tests --include='*.py'; then
    tiers="$tiers $tier"
  else
    echo "== pytest (-m $tier): no tests carry this marker yet"
  fi
done

echo "== pytest (default tier)"
# --durations: the slowest tests are named in every log, to keep this tier near 20 minutes.
default_began=$SECONDS
.venv/bin/python -m pytest \
  -m "not faults and not browser and not slow and not convergence and not cluster and not cdc" \
  --durations=30 "$@"
# With BACKFILL_TIERS_BUDGET_S (CI sets it below its time limit), a tier whose worst measured
# time would end past the budget is skipped, and says so, instead of the whole run being cut
# off at the limit. The worst times (seconds, the cluster tier with its production-shaped
# stack) are about 1.5x the slowest runs measured (docs/ci.md), on a machine where the default
# tier takes about DEFAULT_TIER_S; on a slower one (the default tier took 1,849 s on one) every
# tier is slower alike, so the worst times are scaled by the default tier's time over that.
declare -A worst_s=([convergence]=900 [cluster]=1500 [browser]=180 [slow]=1800 [faults]=1000 [cdc]=600)
DEFAULT_TIER_S=1000
slower_pct=$(( (SECONDS - default_began) * 100 / DEFAULT_TIER_S ))
[ "$slower_pct" -ge 100 ] || slower_pct=100
for tier in $tiers; do
  worst=$(( ${worst_s[$tier]:-0} * slower_pct / 100 ))
  if [ -n "${BACKFILL_TIERS_BUDGET_S:-}" ] \
    && [ $((SECONDS + worst)) -gt "$BACKFILL_TIERS_BUDGET_S" ]; then
    echo "== pytest (-m $tier): SKIPPED: ${SECONDS}s into scripts/test.sh, and its worst time" \
      "(${worst}s: ${worst_s[$tier]:-0}s x ${slower_pct}% for this machine's default tier)" \
      "would end past BACKFILL_TIERS_BUDGET_S=$BACKFILL_TIERS_BUDGET_S"
    continue
  fi
  echo "== pytest (-m $tier)"
  .venv/bin/python -m pytest -m "$tier" --durations=10 "$@"
  if [ "$tier" = cluster ]; then
    # The same marker on the production-shaped stack (backfill_assets_tests/support/
    # cluster_stack.py): Postgres, S3Proxy, 3 SASL/SCRAM TLS brokers, a Spark standalone cluster
    # behind a Spark Connect server. The modules above start their own servers instead. The
    # exactness and fault modules run there too (their slow Berlin test starts a local stack of
    # its own, so it stays in the slow tier); of the injected-fault cases, the small-window
    # ones: the large-window way differs from it only in where the figures are summed (driver
    # or Spark), which the default tier covers, not in anything the stack changes.
    echo "== pytest (cluster stack: test_cluster, exactness, faults, archive logs; BACKFILL_TEST_STACK=cluster)"
    BACKFILL_TEST_STACK=cluster .venv/bin/python -m pytest \
      -m "cluster or faults or not (slow or browser or convergence)" \
      -k "not (each_check_blocks and large)" --durations=10 "$@" \
      backfill_assets_tests/test_cluster.py backfill_assets_tests/lake/test_exactness.py \
      backfill_assets_tests/lake/test_rollback_faults.py backfill_assets_tests/lake/test_faults.py \
      backfill_assets_tests/lake/test_archive_log.py
  fi
done
