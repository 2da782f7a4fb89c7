#!/usr/bin/env bash
# Every benchmark quoted in BENCHMARKS.md, one at a time (2 shared cores: nothing else heavy
# may run alongside). Results go to results/ (gitignored); tables: benchmarks/tables.py.
# Peers must be installed first: `threefold bench peers install all` and
# `threefold bench peers convert --model smollm2-135m`.
# About 55 minutes on a 2-vCPU machine. Run from the repository root.
set -euo pipefail
PY=.venv/bin/python
TF=.venv/bin/threefold
mkdir -p results

# 1. Batch-1 decode: 128 greedy tokens, each configuration in its own process, 3 interleaved rounds.
$PY benchmarks/decode.py --rounds 3 --reps 2 --max-tokens 128 \
  --engines threefold:bf16,transformers:bf16,threefold:fp32,transformers:fp32,llamacpp:t2,llamacpp:t1,vllm:bf16,threefold:bf16+passive \
  --out-dir results/decode

# 2. Offline throughput on ShareGPT first turns (output = reply length capped at 256, EOS ignored).
$PY benchmarks/offline_peers.py --model smollm2-135m --dataset sharegpt --num-prompts 200 --max-output-len 256 \
  --engines threefold,vllm --rounds 1 --out-dir results/offline200
# transformers (static batches of 16) on the first 32 of the same 200 prompts, threefold alongside
$PY benchmarks/offline_peers.py --model smollm2-135m --dataset sharegpt --num-prompts 32 --max-output-len 256 \
  --engines threefold,transformers --batch-size 16 --rounds 1 --out-dir results/offline32

# 3. Serving: each server started alone; fresh ShareGPT prompts per point, same prompts across servers.
$TF bench sweep --model smollm2-135m --server threefold --server vllm --server llamacpp \
  --concurrencies 8,32 --num-prompts 32 --max-output-len 128 --ignore-eos --suppress-eos --num-warmups 2 \
  --no-progress --out-dir results/sweep
$TF bench sweep --model smollm2-135m --server threefold --server vllm --server llamacpp \
  --server "threefold-active=env OMP_WAIT_POLICY=ACTIVE $PY -m threefold.cli serve --model {model} --port {port} --max-model-len 2048" \
  --concurrencies 1 --num-prompts 8 --max-output-len 128 --ignore-eos --suppress-eos --num-warmups 2 \
  --no-progress --out-dir results/sweep_c1
#    64 concurrent clients against threefold serve
$TF bench sweep --model smollm2-135m --server threefold \
  --concurrencies 64 --num-prompts 64 --max-output-len 128 --ignore-eos --num-warmups 2 \
  --no-progress --out-dir results/sweep_c64

# 4. Multi-turn sessions, prefix caching on vs off (chat endpoint, history resent each turn).
$TF bench sweep --model smollm2-135m --dataset sharegpt-sessions --num-prompts 8 --max-output-len 128 \
  --think-time 1.0 --ignore-eos --concurrencies 8 --no-progress --out-dir results/sessions \
  --server "prefix-on=$PY -m threefold.cli serve --model {model} --port {port} --max-model-len 2048" \
  --server "prefix-off=$PY -m threefold.cli serve --model {model} --port {port} --max-model-len 2048 --no-prefix-caching"

# 5. Quality of bf16 against the fp32 reference on held-out ShareGPT text.
$TF bench quality --model smollm2-135m --dtype bfloat16 --num-sequences 8 --seq-len 512 \
  --out results/quality_bf16.json

# Tables
$PY benchmarks/tables.py offline results/offline200/offline_*.json results/offline32/offline_*.json
$PY benchmarks/tables.py serve results/sweep/*_c*_round*.json results/sweep_c1/*_c*_round*.json results/sweep_c64/*_c*_round*.json
$PY benchmarks/tables.py turns results/sessions/*_round*.json
