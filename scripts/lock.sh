#!/usr/bin/env bash
# Regenerate the locks: resolve pyproject.toml (with the dev extras) in a throwaway virtualenv,
# pin every package it installed, and give each pin the sha256 of every file PyPI holds for
# that version (uv pip compile --generate-hashes; uv is installed, pinned, into the throwaway
# virtualenv). Run it after changing a dependency in pyproject.toml.
#   requirements.lock                   everything, dev extras included: scripts/bootstrap.sh
#                                       installs it (hash-checked, since every line has hashes),
#                                       then the project without deps
#   infra/production/requirements.lock  the project's dependencies and the image's one
#                                       production extra (dagster-k8s) at the same versions,
#                                       hashed: the image installs it with --require-hashes
#   infra/production/pip.lock           the pip that made these locks, hashed: the image
#                                       installs it first (the base image's pip 23 cannot read
#                                       a hashed lock whose packages ask for extras, gql[requests])
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
DAGSTER_K8S="dagster-k8s==0.29.27"  # infra/production/Dockerfile: released with dagster-postgres
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q ".[dev]"
"$tmp/venv/bin/python" -m pip freeze --exclude backfill_assets > "$tmp/freeze.txt"
pyver=$("$tmp/venv/bin/python" -c 'import sys; print(".".join(map(str, sys.version_info[:2])))')
"$tmp/venv/bin/python" -m pip install -q "uv==$UV_VERSION"
compile() {
  "$tmp/venv/bin/uv" pip compile --quiet --generate-hashes --python-version "$pyver" \
    --no-header --no-annotate "$@"
}
{
  echo "# Every package the project and its dev extras install, pinned and hashed (scripts/lock.sh"
  echo "# made it from pyproject.toml on Python $pyver)."
  compile "$tmp/freeze.txt"
} > requirements.lock
echo "$DAGSTER_K8S" > "$tmp/production.in"
{
  echo "# The production image's packages: pyproject.toml's dependencies and $DAGSTER_K8S, at"
  echo "# requirements.lock's versions, hashed (scripts/lock.sh made it on Python $pyver)."
  compile pyproject.toml "$tmp/production.in" -c "$tmp/freeze.txt"
} > infra/production/requirements.lock
pip_version=$("$tmp/venv/bin/python" -m pip --version | cut -d' ' -f2)
echo "pip==$pip_version" > "$tmp/pip.in"
{
  echo "# The pip the production image installs first, hashed (scripts/lock.sh)."
  compile "$tmp/pip.in"
} > infra/production/pip.lock
echo "lock: wrote requirements.lock ($(grep -c '^[A-Za-z0-9]' requirements.lock) packages)" \
  "and infra/production/requirements.lock ($(grep -c '^[A-Za-z0-9]' infra/production/requirements.lock))," \
  "infra/production/pip.lock (pip $pip_version)"
