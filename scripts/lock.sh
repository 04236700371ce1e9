#!/usr/bin/env bash
# Regenerate requirements.lock: resolve pyproject.toml (with the dev extras) in a throwaway
# virtualenv and pin every package it installed. Run it after changing a dependency in
# pyproject.toml; scripts/bootstrap.sh installs from the lock, then the project without deps.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
"$tmp/venv/bin/python" -m pip install -q ".[dev]"
{
  echo "# Every package the project and its dev extras install, pinned (scripts/lock.sh made it"
  echo "# from pyproject.toml on Python $("$tmp/venv/bin/python" -c 'import sys; print(".".join(map(str, sys.version_info[:2])))'))."
  "$tmp/venv/bin/python" -m pip freeze --exclude backfill_assets
} > requirements.lock
echo "lock: wrote requirements.lock ($(grep -vc '^#' requirements.lock) packages)"
