"""KV tiers across processes and HTTP servers (issue 12): a new `threefold serve` process finds on
disk what an engine in another process computed (a restart), and the prefix another server wrote
to one real Redis (two instances), both seen in its usage and its /metrics.

One subprocess server (a start costs ~13 s here); the other engines run in this process on the
shared fp32 weights. The subprocess starts once the disk holds the first prefix (L3 indexes its
directory at startup) and loads while the in-process server writes the second prefix to Redis.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from threefold.kvstore import OffloadConfig
from threefold.sample.params import SamplingParams

from server_harness import ServerProcess, ServerThread

BLOCK_BYTES_FP32 = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64, fp32, 16-token blocks
POOL = {"max_model_len": 512, "kv_cache_memory": 40 * BLOCK_BYTES_FP32}
FULL_BLOCK_TOKENS = 144  # of a 150-token prompt: 9 whole blocks (the last token is always computed)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(150)]


def complete(url: str, token_ids: list[int]) -> dict:
    body = {"model": "smollm2-135m", "prompt": token_ids, "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def by_tier(reply: dict) -> dict[str, int]:
    return reply["usage"]["prompt_tokens_details"].get("cached_tokens_by_tier") or {}


def tier_hits(url: str) -> dict[str, float]:
    hits = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "threefold:kv_offload_hits_total":
                hits[sample.labels["tier"]] = sample.value
    return hits


def test_a_new_server_process_hits_disk_after_restart_and_redis_for_another_servers_prefix(
        make_llm, redis_server, tmp_path):
    disk = str(tmp_path / "kv")
    before_restart = make_llm(kv_offload=OffloadConfig(disk_dir=disk), **POOL)
    [first] = before_restart.generate([{"prompt_token_ids": prompt(1)}], SamplingParams(max_tokens=4, temperature=0))
    before_restart.close()  # flushes the writer: the blocks are on disk, and this engine is gone

    args = ["--model", "smollm2-135m", "--served-model-name", "smollm2-135m", "--dtype", "float32",
            "--max-model-len", "512", "--kv-cache-memory", str(POOL["kv_cache_memory"]),
            "--kv-offload-disk", disk, "--kv-offload-redis", redis_server.url]
    b = ServerProcess(args, tmp_path / "b.log")
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(b.__enter__)
        with ServerThread(make_llm(kv_offload=OffloadConfig(redis_url=redis_server.url), **POOL).engine) as a:
            from_a = complete(a.url, prompt(2))
            assert by_tier(from_a).get("redis", 0) == 0  # A computed it
        # leaving A's server closed its store: every block A wrote is in Redis now
        starting.result()
    try:
        restarted = complete(b.url, prompt(1))
        shared = complete(b.url, prompt(2))
        assert by_tier(restarted) == {"disk": FULL_BLOCK_TOKENS}, b.log()[-2000:]
        assert by_tier(shared) == {"redis": FULL_BLOCK_TOKENS}
        assert tier_hits(b.url) == {"disk": 9, "redis": 9}
        # Loaded KV is the KV the other processes computed: the same greedy continuations.
        assert restarted["choices"][0]["text"] == first.outputs[0].text
        assert shared["choices"][0]["text"] == from_a["choices"][0]["text"]
    finally:
        b.__exit__()
