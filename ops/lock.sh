#!/usr/bin/env bash
# Writes ops/constraints.txt: installs the project into a fresh virtual environment with the newest
# versions its ranges allow, then records every distribution's version there. Run it (`make lock`),
# run `make test` on the result, and commit the file once the suite passes: ops/install.sh installs
# exactly those versions, so every fresh machine gets the set that passed.
# Left out: the project itself, torch and the nvidia-*-cu* CUDA libraries its CUDA builds pin, which
# ops/install.sh chooses per machine (a CPU build, or CUDA's where there is a GPU). triton stays: on a
# CPU it comes from the test extras; where there is a GPU, ops/install.sh lets torch choose it.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK_VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$LOCK_VENV")"' EXIT
VENV="$LOCK_VENV" PDSERVE_CONSTRAINTS= bash ops/install.sh >/dev/null
{
  echo "# Written by ops/lock.sh on $(date -u +%Y-%m-%d) with $("$LOCK_VENV/bin/python" -V); do not edit by hand."
  "$LOCK_VENV/bin/python" -m pip freeze --exclude-editable \
    | grep -v -E '^(torch|nvidia-[a-z0-9-]+-cu[0-9]+)==' | grep -v -E '^pdserve( |=|@)' | LC_ALL=C sort -f
} > ops/constraints.txt.new
mv ops/constraints.txt.new ops/constraints.txt
echo "wrote ops/constraints.txt ($(grep -c '==' ops/constraints.txt) pins)"
