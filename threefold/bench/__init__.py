"""Benchmarks: workloads, the load generator, quality evaluation, peers, reports.

    datasets.py / sharegpt.py   ShareGPT first turns and sessions, HumanEval, random (token-counted)
    client.py                   one streamed OpenAI request, timed chunk by chunk
    loadgen.py                  Poisson arrivals, concurrency cap, multi-turn sessions
    metrics.py                  TTFT/TPOT/ITL/E2E percentiles, throughput, goodput, cache hits
    serve.py                    `bench serve`: workload -> run -> results JSON
    sweep.py                    `bench sweep`: start servers, run load points, stop them
    report.py                   `bench report`: markdown table + plots
    quality.py                  `bench quality`: perplexity, KL and top-1 agreement vs fp32
    offline.py                  `bench offline`: batch throughput of threefold / vLLM / transformers
    peers.py                    vLLM CPU and llama.cpp in their own venvs; GGUF -> HF conversion
"""
