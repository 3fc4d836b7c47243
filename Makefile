# Everything installs into .venv from pyproject.toml, pinned by constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test docs bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,keras]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/mirrored demo

test: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest -n 2 --dist loadfile

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	@echo "open site/index.html"

bench: $(STAMP)
	$(BIN)/python benchmarks/step_overhead.py
	$(BIN)/python benchmarks/input_pipeline.py
	$(BIN)/python benchmarks/fit_throughput.py
	$(BIN)/python benchmarks/mixed_precision.py
	$(BIN)/python benchmarks/real_models.py
	$(BIN)/python benchmarks/loop_ops.py
	$(BIN)/python benchmarks/flax_tutorial.py
	$(BIN)/python benchmarks/keras_models.py
	$(BIN)/python benchmarks/time_to_first_step.py
	$(BIN)/python benchmarks/debugging.py
	$(BIN)/python benchmarks/preemption_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
