# Baton — every target runs inside .venv/ (made by `make install`).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
TINY    := tiny-model

.PHONY: install run test test-gpu lint format bench clean

install:  ## create .venv and install Baton with its pinned dependencies
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

$(TINY)/config.json:
	$(PY) -m baton.cli make-tiny-model $(TINY) --arch qwen3

run: $(TINY)/config.json  ## offline demo: generate text with a tiny model made on the fly
	$(PY) -m baton.cli generate --model $(TINY) --max-tokens 24

test:  ## unit + integration + e2e on CPU (GPU tests are skipped without CUDA)
	$(PY) -m pytest -q tests

test-gpu:  ## the GPU tests only (run on the GPU machine)
	$(PY) -m pytest -q -m gpu tests

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy shared services baton

format:
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench: $(TINY)/config.json  ## offline throughput at a small scale on this machine
	$(PY) benchmarks/throughput.py --model $(TINY) --num-prompts 32 --min-len 32 --max-len 256 --compare-hf

clean:
	rm -rf $(TINY) .pytest_cache .mypy_cache .ruff_cache
