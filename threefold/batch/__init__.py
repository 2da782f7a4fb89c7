"""The OpenAI Batch API's engine-agnostic core: durable store, input validation, the runner (no torch here)."""
