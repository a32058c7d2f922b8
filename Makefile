# The two commands the README promises: `make demo` and `make test`. Both set up everything
# first (Open MPI, .venv, Horovod built from its sdist and cached outside the repo).
VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench bench-quick bench-gpu lint clean-venv

setup:
	@bash scripts/setup.sh

lint: setup
	$(PY) -m ruff check grace_dl tests benchmarks examples

test: setup lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	@bash examples/demo.sh

bench: setup
	$(PY) -m benchmarks.run

bench-quick: setup
	$(PY) -m benchmarks.run --quick

# On a machine with a CUDA GPU and Triton (no Horovod needed): the compressor and step tables.
bench-gpu:
	PYTHONPATH=. python3 -m benchmarks.gpu all --out benchmarks/results

clean-venv:
	rm -rf $(VENV)
