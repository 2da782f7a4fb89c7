"""The KV tiers' own costs, no model: what an offloaded block costs the engine thread, how fast the
writer drains to each tier, and each tier's read bandwidth (what the load-or-recompute choice uses).

    flock /tmp/threefold-bench.lock python benchmarks/kvstore_tiers.py [--num-blocks 64] [--rounds 3]

Block sizes are SmolLM2-135M's 16-token blocks over all 30 layers: fp32 (720 KiB) and int8 (191 KiB:
codes and a scale per row).
A redis-server is started on a free loopback port (Debian's package: `make redis`). Disk reads come
from the page cache (the blocks were just written): the number is an upper bound for a cold disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore

BLOCK_SIZES = {"fp32": 30 * 2 * 3 * 64 * 16 * 4, "int8": 30 * 2 * 3 * 16 * (64 + 4)}
NS = Namespace("bench", "auto", 16)


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", workdir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return process, f"redis://127.0.0.1:{port}/0"


def tier_configs(workdir: str, redis_url: str) -> dict[str, dict]:
    return {"cpu": {"cpu_bytes": 4 << 30}, "disk": {"disk_dir": f"{workdir}/disk"},
            "redis": {"redis_url": redis_url}}


def measure_tier(config: dict, block_bytes: int, num_blocks: int, seed: int) -> dict:
    """put() on the caller's thread, the writer's drain rate, then get() of every block from this tier."""
    blocks = [((seed * 100_000 + i).to_bytes(32, "little"), os.urandom(block_bytes)) for i in range(num_blocks)]
    with TieredKVStore(OffloadConfig(**config), NS) as store:
        put_us = []
        start = time.perf_counter()
        for block_hash, payload in blocks:
            t0 = time.perf_counter()
            store.put(block_hash, payload)
            put_us.append((time.perf_counter() - t0) * 1e6)
        store.flush()
        drain_s = time.perf_counter() - start
        get_s = []
        for block_hash, payload in blocks:
            t0 = time.perf_counter()
            found = store.get(block_hash)
            get_s.append(time.perf_counter() - t0)
            assert found is not None and found[1] == payload
        stats = store.stats()
    (tier_stats,) = stats.tiers.values()
    return {"put_us_median": statistics.median(put_us), "put_us_p99": sorted(put_us)[int(0.99 * len(put_us))],
            "write_MBps": num_blocks * block_bytes / drain_s / 1e6,
            "get_ms_median": statistics.median(get_s) * 1e3,
            "read_GBps": num_blocks * block_bytes / sum(get_s) / 1e9, "ema_GBps": tier_stats.bandwidth / 1e9,
            "dropped": stats.dropped_writes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", default="results/kvstore")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed: run `make redis`")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        redis, url = start_redis(workdir)
        try:
            for round_index in range(args.rounds):  # interleaved: every tier in every round
                for codec, block_bytes in BLOCK_SIZES.items():
                    for tier, config in tier_configs(workdir, url).items():
                        seed = round_index * 10 + len(rows)
                        rows.append({"round": round_index, "tier": tier, "block": codec, "block_bytes": block_bytes,
                                     **measure_tier(config, block_bytes, args.num_blocks, seed)})
                        shutil.rmtree(f"{workdir}/disk", ignore_errors=True)
        finally:
            redis.kill()
            redis.wait()
    print(f"CPU: {platform.processor() or platform.machine()}; {args.num_blocks} blocks x {args.rounds} rounds; "
          "medians over rounds")
    print("| tier | block | put() on the engine thread, us (median / p99) | writer drain, MB/s | get() ms "
          "| read GB/s |")
    print("|---|---|---|---|---|---|")
    for codec in BLOCK_SIZES:
        for tier in ("cpu", "disk", "redis"):
            mine = [r for r in rows if r["tier"] == tier and r["block"] == codec]
            med = {k: statistics.median(r[k] for r in mine) for k in mine[0] if isinstance(mine[0][k], float)}
            # L2 has no writer and get() hands back the stored bytes object: no drain rate, no copy to time.
            drain, read = ("-", "-") if tier == "cpu" else (f"{med['write_MBps']:.0f}", f"{med['read_GBps']:.2f}")
            print(f"| {tier} | {codec} {mine[0]['block_bytes'] >> 10} KiB | {med['put_us_median']:.1f} / "
                  f"{med['put_us_p99']:.1f} | {drain} | {med['get_ms_median']:.3f} | {read} |")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kvstore_tiers.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
