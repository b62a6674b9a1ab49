# The two commands a fresh machine needs (see README): `make demo` and `make test`.
.PHONY: demo test setup setup-agents setup-prometheus unit check check-cuda

setup:
	@bash scripts/setup.sh

setup-agents:
	@bash scripts/setup_agents.sh

# Debian's prometheus binary, unpacked into .cache/ for the dashboard test (not fatal)
setup-prometheus:
	@bash scripts/setup_prometheus.sh

demo: setup
	.venv/bin/mars demo

test: setup setup-agents setup-prometheus
	bash scripts/run_tests.sh

unit: setup
	.venv/bin/python -m pytest -q -m "not engine" --ignore=tests/agents

# pytest workers for `make check` (scripts/run_tests.sh reads the same variable): the cores, at
# most 4
MARS_TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))

# the tier for every commit (~1.5 min here on two workers): no engine, no slow fit, 120 of the
# 1,080 invariant cases per scheduler class; `make test` runs everything
check: setup
	MARS_INVARIANT_CASES=120 .venv/bin/python -m pytest -q -p no:cacheprovider \
	    -n $(MARS_TEST_WORKERS) -m "not engine and not slow" --ignore=tests/agents tests

# resolve the CUDA install with pip --dry-run (network, ~3 min; not part of `make test`)
check-cuda:
	bash scripts/check_cuda_install.sh
