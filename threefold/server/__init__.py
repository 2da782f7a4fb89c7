"""The OpenAI-compatible HTTP server.

    cli.py                 `threefold serve`: load, wire, run uvicorn, drain on SIGTERM
    app.py                 FastAPI routes + the middleware (auth, drain 503, abort-on-exit)
    serving_completions.py /v1/completions      serving_chat.py  /v1/chat/completions
    serving_tokenize.py    /tokenize, /detokenize, /tokenizer_info
    serving_common.py      admission (overload 503), sampling params, SSE, usage
    protocol.py            request bodies        logprobs.py  the two logprobs formats
    metrics.py             Prometheus under vLLM's names      errors.py  OpenAI-shaped errors

The server reaches the engine only through threefold.engine.async_engine.AsyncEngine.
"""
