# `make serve` and `make test` do all set-up on a fresh machine.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(VPY) -m pip install -q --disable-pip-version-check -c requirements/constraints.txt
ARGS    ?=

.PHONY: serve test test-slow setup model bench lint clean image-check

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,bench,lint]'
	touch $(STAMP)

setup: $(STAMP)

model: $(STAMP)
	$(VPY) -m servelm.runtime.model_files
	$(VPY) -m servelm.runtime.model_fetch

serve: model
	$(VENV)/bin/servelm serve $(ARGS)

# Two tiers (docs/testing.md): `make test` leaves out the tests marked slow, `make test-slow` runs only
# them; together they are the whole suite, and CI runs both.
test: model
	$(VPY) -m pytest -q -m "not slow" $(ARGS)

test-slow: model
	$(VPY) -m pytest -q -m slow $(ARGS)

bench: model
	$(VPY) scripts/bench_engine.py $(ARGS)

# hadolint, ruff (lint, then the formatter's check), mypy. mypy reads the folders under the names they
# install as (pyproject's package-dir: servelm.server is server/, ...) through links in build/mypy/servelm.
lint: $(STAMP)
	$(VENV)/bin/hadolint --failure-threshold warning Dockerfile
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	mkdir -p build/mypy/servelm
	for p in server scheduler runtime metrics bench; do ln -sfn ../../../$$p build/mypy/servelm/$$p; done
	$(VENV)/bin/mypy

# Build the CPU image with podman from a local Debian base and check it runs (docker/image/image_check.sh).
image-check:
	docker/image/image_check.sh

clean:
	rm -rf $(VENV) .pytest_cache
