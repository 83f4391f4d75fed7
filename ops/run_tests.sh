#!/usr/bin/env bash
# Runs pytest from the project's virtual environment; "no tests collected" (exit 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# One BLAS thread a process: the suite runs engines in several processes at once, and
# oversubscribed cores made it several times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
