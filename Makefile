# The two set-up commands of the README:
#   make serve   install everything, then run the whole stack (Redis, router, prefill, decode)
#   make test    install everything, then lint, type-check and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install lock serve test lint typecheck pytest bench-offline bench-kv

install:
	bash ops/install.sh

# Re-resolve every dependency to its newest allowed version into ops/constraints.txt (then run
# `make test` and commit it if the suite passes).
lock:
	bash ops/lock.sh

serve: install
	$(VENV)/bin/pdserve up $(ARGS)

lint:
	$(VENV)/bin/ruff check .

typecheck:
	$(VENV)/bin/mypy common pdserve_kernels kvtransfer router prefill_svc decode_svc ops

pytest:
	bash ops/run_tests.sh $(PYTEST_ARGS)

# The type check runs beside the tests: they leave a core idle for much of the run (waiting on the
# processes they start), which it fills.
test: install lint
	$(MAKE) --no-print-directory -j2 typecheck pytest

bench-offline:
	$(VENV)/bin/pdserve bench offline $(ARGS)

bench-kv:
	$(VENV)/bin/pdserve bench kv $(ARGS)
