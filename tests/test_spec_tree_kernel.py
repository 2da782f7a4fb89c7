"""Candidate trees in the native decode kernel (worker/tree_verify.py: the tree rows as one decode
group with an ancestor bitmask) against the brute-force masked attention of spec/tree.py and against
the torch tree path, on random trees: dense caches in every build this CPU runs, the codec caches
(int8, fp8, int4 in kv_attention.cpp; turboquant in tq_attention.cpp), and a whole step's batch
(decodes, a chain verify, trees, a prefill chunk) through PagedAttention with the kernel on and off."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from threefold.env import Env
from threefold.kernels import available_targets, build_kernels, cpu_kernels
from threefold.kv.native import decode_attention
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.sample.params import SamplingParams
from threefold.spec.proposer import ROOT
from threefold.spec.tree import masked_attention, verify_mask
from threefold.worker.attention import PagedAttention
from threefold.worker.batch import CachedRequestState, build_batch
from threefold.worker.block_table import BlockTable
from threefold.worker.tree_verify import tree_bits

CONTEXTS = [0, 7, 16, 45, 130]
TREE_SIZES = [1, 4, 12, 70, 30]  # nodes; 70 needs a second word of bits


def _skip_without_kernels() -> None:
    if sys.platform != "linux" or Env.read().attention_backend == "torch":
        pytest.skip("native kernels are built on Linux unless THREEFOLD_ATTENTION=torch")


@pytest.fixture(scope="module", params=available_targets() or ["native"])
def any_build(request):
    """Each kernel build this CPU can run (the AVX2 build routes tree rows off its vector path)."""
    _skip_without_kernels()
    return build_kernels(request.param)


@pytest.fixture(scope="module")
def kernels():
    _skip_without_kernels()
    module = cpu_kernels()
    assert module is not None, "the native kernels failed to build"
    return module


def random_tree(num_nodes: int, rng: random.Random) -> list[int]:
    """Parent ids, parents before children: bushy near the root, some long paths."""
    return [ROOT if i == 0 or rng.random() < 0.2 else rng.randrange(max(0, i - 6), i) for i in range(num_nodes)]


def tree_rows(contexts: list[int], trees: list[list[int]], block_size: int, rng: random.Random):
    """The kernel's operands for every tree row of the requests (request b: context contexts[b],
    tree trees[b], its tree rows at slots context..context + N), plus one plain decode row at the
    end (no mask: its tree start is past its keys). Returns (tables, seq_lens, starts, bits, owner,
    row in tree) with block tables drawn at random from one pool."""
    words = -(-max(len(t) + 1 for t in trees) // 64)
    widths = [-(-(c + len(t) + 1) // block_size) for c, t in zip(contexts, trees, strict=True)]
    width = max(widths) + 1
    pool = torch.randperm(len(contexts) * width + 8, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    request_tables = pool[1 : 1 + len(contexts) * width].view(len(contexts), width)
    tables, lens, starts, bits, owner, index = [], [], [], [], [], []
    for b, (context, parents) in enumerate(zip(contexts, trees, strict=True)):
        packed = tree_bits(parents, words)
        for r in range(len(parents) + 1):
            tables.append(request_tables[b])
            lens.append(context + r + 1)
            starts.append(context)
            bits.append(packed[r])
            owner.append(b)
            index.append(r)
    tables.append(request_tables[0])  # a plain decode among the tree rows
    lens.append(contexts[0] + 1)
    starts.append(contexts[0] + 1)
    bits.append(torch.zeros(words, dtype=torch.long))
    owner.append(0)
    index.append(-1)
    return (torch.stack(tables).contiguous(), torch.tensor(lens), torch.tensor(starts), torch.stack(bits).contiguous(),
            owner, index)


def brute_force(q, keys, values, tables, contexts, trees, owner, index, block_size, scale):
    """Each row on its own: gather its request's keys in order, visible = the context plus its
    ancestors in the tree (spec/tree.verify_mask); fp32 softmax."""
    out = torch.empty_like(q)
    for row, (b, r) in enumerate(zip(owner, index, strict=True)):
        context, parents = contexts[b], trees[b]
        total = context + (r + 1 if r >= 0 else 1)
        pos = torch.arange(total)
        slots = tables[row, pos // block_size] * block_size + pos % block_size
        visible = torch.ones(1, total, dtype=torch.bool)
        if r >= 0:
            visible[0, context:] = verify_mask(parents)[r, : r + 1]
        out[row : row + 1] = masked_attention(q[row : row + 1], keys[slots], values[slots], visible, scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2's shape
    (4, 4, 128, 4),     # no GQA, the other specialized head_dim, small blocks
    (6, 2, 48, 8),      # a head_dim with no specialization
])
def test_dense_kernel_tree_rows_match_brute_force(any_build, dtype, heads, kv_heads, head_dim, block_size):
    rng = random.Random(head_dim)
    trees = [random_tree(n, rng) for n in TREE_SIZES]
    tables, lens, starts, bits, owner, index = tree_rows(CONTEXTS, trees, block_size, rng)
    gen = torch.Generator().manual_seed(0)
    num_blocks = int(tables.max()) + 1
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    any_build.paged_decode_attention(out, q, cache[0], cache[1], tables, lens, scale, 0, starts, bits)
    flat = [c.reshape(-1, kv_heads, head_dim) for c in cache]
    expected = brute_force(q, *flat, tables, CONTEXTS, trees, owner, index, block_size, scale)
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tolerance)
    # Not a plain causal pass: without the mask the rows of a bushy tree read their siblings.
    plain = torch.empty_like(q)
    empty = torch.empty(0, dtype=torch.long)
    any_build.paged_decode_attention(plain, q, cache[0], cache[1], tables, lens, scale, 0, empty, empty)
    assert not torch.allclose(plain.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("spec", ["int8", "fp8", "int4", "turboquant"])
def test_codec_kernel_tree_rows_match_brute_force(kernels, spec):
    """The compressed caches' kernels (turboquant: tq_attention.cpp, against its codec's dense read)."""
    rng = random.Random(1)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    trees = [random_tree(n, rng) for n in TREE_SIZES]
    tables, lens, starts, bits, owner, index = tree_rows(CONTEXTS, trees, block_size, rng)
    gen = torch.Generator().manual_seed(2)
    num_blocks = int(tables.max()) + 1
    codec = make_codec(spec, kv_heads, head_dim, torch.float32)
    storage = codec.allocate(num_blocks, block_size, torch.device("cpu"))
    slots = torch.arange(num_blocks * block_size)
    codec.write(storage, slots, torch.randn(len(slots), kv_heads, head_dim, generator=gen),
                torch.randn(len(slots), kv_heads, head_dim, generator=gen))
    keys, values = codec.read(storage, torch.arange(num_blocks)[None])  # [1, kvh, L, d]: every slot, decoded
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    decode_attention(kernels, out, q, codec.layout(storage), tables, lens, scale, 0, starts, bits)
    expected = brute_force(q, keys[0].transpose(0, 1), values[0].transpose(0, 1), tables, CONTEXTS, trees, owner,
                           index, block_size, scale)
    torch.testing.assert_close(out, expected, atol=3e-5, rtol=1e-5)


def _state(request_id: str, num_tokens: int, computed: int, row: int) -> CachedRequestState:
    tokens = list(range(5, 5 + num_tokens))
    return CachedRequestState(request_id, tokens, num_tokens, SamplingParams(), row, computed, None)


@pytest.mark.parametrize("spec", ["auto", "int8"])
def test_step_with_trees_through_the_kernel_equals_the_torch_path(kernels, spec):
    """One step mixing two decodes, a chain verify, three trees and a prefill chunk: the kernel's
    tree decode group gives what the torch path's per-tree SDPA calls give, row for row."""
    rng = random.Random(3)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    table = BlockTable(block_size)
    #           id       tokens computed scheduled  tree
    requests = [("d0", 30, 29, 1, None), ("d1", 81, 80, 1, None), ("chain", 50, 49, 4, None),
                ("t0", 20, 19, 9, random_tree(8, rng)), ("t1", 100, 99, 71, random_tree(70, rng)),
                ("t2", 1, 0, 4, random_tree(3, rng)), ("prefill", 60, 33, 27, None)]
    states, next_block = [], 1
    for row, (rid, num_tokens, computed, scheduled, _) in enumerate(requests):
        num_blocks = -(-(computed + scheduled) // block_size)
        table.add_row(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
        states.append(_state(rid, num_tokens, computed, row))
    scheduled = {rid: n for rid, _, _, n, _ in requests}
    drafts = {rid: [7] * (n - 1) for rid, tokens, computed, n, _ in requests if computed + 1 == tokens and n > 1}
    trees = {rid: tree for rid, *_, tree in requests if tree is not None}
    native = build_batch(states, scheduled, drafts, table, torch.device("cpu"), native_decode=True, trees=trees)
    plain = build_batch(states, scheduled, drafts, table, torch.device("cpu"), native_decode=False, trees=trees)
    assert not native.attn.tree_groups and native.attn.decode_groups[-1].tree_bits is not None
    assert len(plain.attn.tree_groups) == 3
    torch.testing.assert_close(native.positions, plain.positions)

    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(make_codec(spec, kv_heads, head_dim, torch.float32), 1, next_block, block_size,
                         torch.device("cpu"))
    context_slots = torch.cat([table.slot_mapping(torch.full((s.num_computed_tokens,), s.row),
                                                  torch.arange(s.num_computed_tokens)) for s in states])
    cache.write(0, context_slots, torch.randn(len(context_slots), kv_heads, head_dim, generator=gen),
                torch.randn(len(context_slots), kv_heads, head_dim, generator=gen))
    num_tokens = len(native.input_ids)
    q = torch.randn(num_tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    scale = head_dim ** -0.5
    through_kernel = PagedAttention(cache, native.attn, scale, torch.float32, kernels)(0, q, k, v)
    through_torch = PagedAttention(cache, plain.attn, scale, torch.float32, None)(0, q, k, v)
    torch.testing.assert_close(through_kernel, through_torch, atol=3e-5, rtol=1e-5)
