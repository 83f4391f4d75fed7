#!/usr/bin/env bash
# Runs pytest from the project's virtual environment; "no tests collected" (exit 5) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# One BLAS thread a process: the suite runs engines in several processes at once, and
# oversubscribed cores made it several times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts a few hundred Python processes (engines, routers, CLIs): let the first write the
# project's bytecode for the rest (with PYTHONDONTWRITEBYTECODE set, each compiled it again: ~0.5 s).
unset PYTHONDONTWRITEBYTECODE
# Triton kernels run under Triton's interpreter on CPUs; set before anything imports triton, since
# the first import fixes how triton's own library functions are decorated (tests/conftest.py).
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
# Test files run in PYTEST_WORKERS processes (pytest-xdist, a whole file to one process so its module
# fixtures start once; 0: one process, no xdist). Much of the suite waits on engine and router
# processes, so two workers keep a 2-core host busy.
WORKERS=${PYTEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != "0" ]; then
  XDIST=(-n "$WORKERS" --dist loadfile)
fi
# In CI, the slowest tests are listed at the end, to watch the suite's time.
REPORT=()
if [ -n "${CI:-}" ]; then
  REPORT=(--durations=15)
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${XDIST[@]}" "${REPORT[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
