"""CPU per byte of the KV offload write path, stage by stage: what each written-through block costs.

    tfrun .venv/bin/python benchmarks/kv_write_path.py            # ~1 min on 2 vCPU; busy is fine

Blocks are SmolLM2-135M's (30 layers, 3 KV heads x 64, 16 tokens, bf16: 360 KiB). Each line is thread
CPU time (time.thread_time: what the block's work takes from the engine's cores, waiting excluded):
  engine thread: the gather of a step's new blocks out of the pool into payload bytes (BlockCodec.encode),
                 the L2 insert (TieredKVStore.put over host memory);
  writer thread: framing (header, copy, CRC-32), and each lower tier's write, measured as the writer's
                 own CPU over N puts and a flush: disk while it fills (its slabs growing), disk
                 when full (every write evicts a block), Redis (loopback, if `redis-server` is installed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable

import torch

from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore
from threefold.kvstore.frame import RecordBuffer
from threefold.worker.kv_block_codec import BlockCodec

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
NS = Namespace("kv-write-path", "auto", BLOCK)


def line(name: str, seconds: float, num_blocks: int, block_bytes: int) -> None:
    per = seconds / num_blocks
    print(f"{name:52s} {1e3 * per:7.3f} ms/block  {block_bytes / per / 1e9 if per else 0:6.2f} GB/s of CPU",
          flush=True)


def cpu_of(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def writer_cpu(config: OffloadConfig, payloads: list[bytes], count: int, warm: int = 0) -> float:
    """The writer thread's CPU seconds for `count` puts (after `warm` puts that fill the tier)."""
    with TieredKVStore(config, NS, writer_cpu_share=1.0) as store:
        for i in range(warm):
            store.put(i.to_bytes(32, "little"), payloads[i % len(payloads)])
        store.flush()
        before = store.stats().writer_cpu_seconds
        for i in range(warm, warm + count):
            store.put(i.to_bytes(32, "little"), payloads[i % len(payloads)])
        store.flush()
        return store.stats().writer_cpu_seconds - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=512, help="blocks per measurement (default 512: 180 MiB)")
    parser.add_argument("--disk-parent", default=None, help="where to make the disk tier's directory (default tmp)")
    ns = parser.parse_args()
    torch.manual_seed(0)
    codec = make_codec("auto", KV_HEADS, HEAD_DIM, torch.bfloat16)
    cache = PagedKVCache(codec, LAYERS, ns.blocks + 1, BLOCK, torch.device("cpu"))
    for layer in range(LAYERS):
        slots = torch.arange((ns.blocks + 1) * BLOCK)
        k, v = (torch.randn(len(slots), KV_HEADS, HEAD_DIM) for _ in range(2))
        cache.write(layer, slots, k, v)
    block_codec = BlockCodec(cache, codec)
    size = block_codec.payload_bytes
    print(f"{ns.blocks} blocks of {size} bytes; CPU time of the thread doing each stage")

    block_ids = list(range(1, ns.blocks + 1))
    block_codec.encode(block_ids[:32])
    payloads: list[bytes] = []
    line("engine: gather into payload bytes (encode)", cpu_of(
        lambda: [payloads.extend(block_codec.encode(block_ids[i:i + 32])) for i in range(0, ns.blocks, 32)]),
        ns.blocks, size)
    with TieredKVStore(OffloadConfig(cpu_bytes=4 * ns.blocks * size), NS) as store:
        line("engine: L2 insert (store.put, host memory only)", cpu_of(
            lambda: [store.put(i.to_bytes(32, "little"), p) for i, p in enumerate(payloads)]), ns.blocks, size)

    buffer = RecordBuffer()
    line("writer: CRC-32 of the payload alone", cpu_of(lambda: [zlib.crc32(p) for p in payloads]), ns.blocks, size)
    line("writer: frame into the RecordBuffer (copy + CRC)", cpu_of(
        lambda: [buffer.pack(p, NS.digest, NS.format_version) for p in payloads]), ns.blocks, size)
    parent = tempfile.mkdtemp(dir=ns.disk_parent)
    try:
        line("writer: frame + disk, filling (slabs growing)", writer_cpu(
            OffloadConfig(disk_dir=os.path.join(parent, "a"), disk_bytes=1 << 40), payloads, ns.blocks),
            ns.blocks, size)
        line("writer: frame + disk, full (each write evicts one)", writer_cpu(
            OffloadConfig(disk_dir=os.path.join(parent, "b"), disk_bytes=(ns.blocks // 4) * (size + 64)),
            payloads, ns.blocks, warm=ns.blocks // 4), ns.blocks, size)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    if shutil.which("redis-server") is None:
        print("writer: Redis: no redis-server installed (make redis)")
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        line("writer: frame + Redis SET (loopback)", writer_cpu(
            OffloadConfig(redis_url=f"redis://127.0.0.1:{port}"), payloads, ns.blocks), ns.blocks, size)
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
