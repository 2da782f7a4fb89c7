"""ModelRunner: SchedulerOutput -> one flattened forward -> sampled tokens.

The runner owns the tensors (weights, paged KV) and a cached copy of each
request; it holds no scheduling state. The single host sync of a step is
the `.tolist()` in `_to_output`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from threefold.core.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from threefold.errors import ThreefoldError
from threefold.kernels import cpu_kernels
from threefold.kv.codec import KVCodec
from threefold.kv.mix import layer_specs, mix_text
from threefold.kv.paged import PagedKVCache
from threefold.kv.registry import make_codec
from threefold.kv.window import ArenaShape, WindowArena, window_dtype
from threefold.model.loader import LoadedModel
from threefold.sample.sampler import Sampler, SamplingMetadata, compute_logprobs_tensors
from threefold.spec.config import SpeculativeConfig
from threefold.spec.runner import SpecRunner
from threefold.worker.attention import LayerDispatch, PagedAttention
from threefold.worker.batch import RequestStates, StepBatch, build_batch
from threefold.worker.kivi_attention import build_kivi_attention
from threefold.worker.kv_offload import KVOffload
from threefold.worker.tree_verify import keep_path


class ModelRunner:
    def __init__(self, loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "auto",
                 device: str | torch.device = "cpu", speculative_config: SpeculativeConfig | None = None,
                 max_model_len: int | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.block_size = block_size
        self.device = torch.device(device)
        specs = layer_specs(kv_cache_dtype, self.config.num_layers)
        self.kv_cache_dtype = mix_text(specs)
        """Canonical text of the cache's codec(s): a plain spec, or a per-layer mix (kv/mix.py)."""
        made: dict[str, KVCodec] = {}
        for spec in specs:
            if str(spec) not in made:
                made[str(spec)] = make_codec(spec, self.config.num_kv_heads, self.config.head_dim, self.config.dtype)
                made[str(spec)].check_block_size(block_size)
        self.codecs = [made[str(spec)] for spec in specs]
        self.codec: KVCodec | None = self.codecs[0] if len(made) == 1 else None
        """The one codec of every layer, or None for a mix."""
        self.window_layers = [i for i, c in enumerate(self.codecs) if c.window_tokens(block_size)]
        """Layers whose codec keeps a full-precision window (KIVI); rows of the window arena, in order."""
        self.arena_shape = ArenaShape.of(self.codecs, block_size)
        self.window_tokens = self.arena_shape.size
        if self.window_tokens and (speculative_config is not None or self.config.sliding_window is not None):
            raise ThreefoldError(f"kv_cache_dtype {self.kv_cache_dtype} does not support speculative decoding or "
                                 f"sliding-window models yet.", param="kv_cache_dtype")
        self.windows: WindowArena | None = None
        """Windowed codecs (KIVI): each running request's full-precision recent tokens."""
        self.eos_token_ids = list(loaded.eos_token_ids)
        self.requests = RequestStates(block_size, self.config.vocab_size, self.device)
        self.kv_cache: PagedKVCache | None = None
        self.kernels = cpu_kernels() if self.device.type == "cpu" else None
        """The native decode-attention kernel, or None: the plain torch path (same results)."""
        self.sampler = Sampler(self.kernels)
        self.spec = None if speculative_config is None else SpecRunner.build(
            speculative_config, loaded, max_model_len or loaded.max_model_len)
        """Speculative decoding's half of the runner (verify + propose), or None."""
        if self.spec is not None:
            self.spec.decoder.argmax = self.sampler.argmax
        self.offload: KVOffload | None = None
        """The KV offload tiers' load/store (set by the engine once the pool exists), or None."""
        self.prompt_logprobs_observer: Callable[[str, int, torch.Tensor], None] | None = None
        """Measurement hook (bench quality): sees the full log-distribution rows
        [n, vocab] of prompt positions starting at a position, per request."""

    def bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(self.codecs, self.config.num_layers, self.block_size)

    def window_bytes_per_seq(self) -> int:
        """Bytes of one running request's full-precision window (0: the codec keeps none)."""
        if not self.window_tokens:
            return 0
        return self.arena_shape.bytes_per_slot(self.config.num_kv_heads, self.config.head_dim,
                                               window_dtype(self.config.dtype))

    def initialize_kv_cache(self, num_blocks: int, num_windows: int = 0) -> None:
        self.kv_cache = PagedKVCache(self.codecs, self.config.num_layers, num_blocks, self.block_size, self.device)
        if self.window_tokens:
            self.windows = WindowArena(self.arena_shape, num_windows, self.config.num_kv_heads, self.config.head_dim,
                                       window_dtype(self.config.dtype), self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(sched)
        if self.windows is not None:
            for request_id in sched.finished_req_ids | sched.preempted_req_ids:
                self.windows.release(request_id)
        if self.spec is not None:
            for request_id in sched.finished_req_ids | sched.preempted_req_ids:
                self.spec.remove(request_id)
        if self.offload is not None:
            # Swap-outs first (a preempted request's freed blocks may be reused this step), then External
            # KV loads into the pool before the forward reads them; even in a step that computes nothing.
            self.offload.swap_out(sched.blocks_to_swap_out)
            self.offload.load(sched.blocks_to_load, step_runs=not sched.is_empty)
        if sched.is_empty:
            return ModelRunnerOutput({})
        states = [self.requests.states[rid] for rid in sched.num_scheduled_tokens]
        trees = None if self.spec is None else self.spec.scheduled_trees(sched.scheduled_spec_token_ids)
        batch = build_batch(states, sched.num_scheduled_tokens, sched.scheduled_spec_token_ids,
                            self.requests.block_table, self.device, self.config.sliding_window,
                            native_decode=self.kernels is not None, trees=trees)
        assert self.kv_cache is not None, "initialize_kv_cache() before execute()"
        attention = self._attention(batch)
        start, computed_before = time.perf_counter(), {s.request_id: s.num_computed_tokens for s in batch.order}
        hidden = self.model(batch.input_ids, batch.positions, attention)
        if self.offload is not None:
            self.offload.observe_step(len(batch.input_ids), time.perf_counter() - start)
            self.offload.store_blocks(sched.blocks_to_store)
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if self.spec is None:
            output = self._sample(batch, hidden)
        else:
            spec_tokens = sched.scheduled_spec_token_ids
            output = self.spec.sample(batch, hidden, spec_tokens, self._sample_logits, trees)
            for rid, path in self.spec.paths.items():  # the accepted path's K/V stay, in sequence order
                state = self.requests.states[rid]
                keep_path(self.kv_cache, self.requests.block_table, state.row, state.num_computed_tokens, path)
            self.spec.observe_step(len(batch.input_ids), time.perf_counter() - start,
                                   sum(len(d) for d in spec_tokens.values()))
            output.draft_token_ids = self.spec.propose(batch, hidden, output, spec_tokens, computed_before,
                                                       sched.num_waiting)
        output.prompt_logprobs = prompt_logprobs
        for state in batch.order:
            state.num_computed_tokens += sched.num_scheduled_tokens[state.request_id]
            if self.windows is not None:
                self.windows.windows[state.request_id].filled = state.num_computed_tokens
        return output

    def _attention(self, batch: StepBatch):
        assert self.kv_cache is not None
        scale = self.config.head_dim ** -0.5
        if self.windows is None:
            return PagedAttention(self.kv_cache, batch.attn, scale, self.config.dtype, self.kernels)
        table = self.requests.block_table
        every_layer = len(self.window_layers) == len(self.codecs)
        rows = None if every_layer else {layer: row for row, layer in enumerate(self.window_layers)}
        windowed = build_kivi_attention(self.kv_cache, self.windows, batch.order, batch.query_starts,
                                        batch.query_lens, lambda state: table.block_ids(state.row), scale, rows,
                                        self.kernels)
        if every_layer:
            return windowed
        paged = PagedAttention(self.kv_cache, batch.attn, scale, self.config.dtype, self.kernels)
        return LayerDispatch(windowed, paged, set(self.window_layers))

    def _sample(self, batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        if not batch.sampling_states:
            return ModelRunnerOutput({})
        # [N, vocab] in the model dtype: a greedy batch takes its max there (bf16: ~4x less to read).
        return self._sample_logits(batch, self.model.compute_logits(hidden[batch.sample_rows], float32=False))

    def _sample_logits(self, batch: StepBatch, logits: torch.Tensor) -> ModelRunnerOutput:
        """One token for each of batch.sampling_states from its row of logits [N, vocab]."""
        if not batch.sampling_states:
            return ModelRunnerOutput({})
        states = batch.sampling_states
        meta = SamplingMetadata.build(
            [s.params for s in states], [s.num_output_tokens for s in states], [s.penalties for s in states],
            {i: s.generator for i, s in enumerate(states) if s.generator is not None},
            self.eos_token_ids, logits.shape[-1], self.device)
        result = self.sampler(logits, meta)
        sampled = result.sampled_token_ids.tolist()
        for state, token_id in zip(states, sampled, strict=True):
            state.token_ids.append(token_id)
            if state.penalties is not None:
                state.penalties.add(token_id)
        output = ModelRunnerOutput({s.request_id: [t] for s, t in zip(states, sampled, strict=True)})
        if result.logprobs is not None:
            for i, state in enumerate(states):
                if state.params.logprobs is not None:
                    output.logprobs[state.request_id] = [_row_logprobs(result.logprobs, i, state.params.logprobs)]
        return output

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, list]:
        """Logprobs of prompt tokens computed this step; returned once a prompt completes."""
        done = {}
        for state, start, n in zip(batch.order, batch.query_starts, batch.query_lens, strict=True):
            num_top = state.params.prompt_logprobs
            first = state.num_computed_tokens
            if num_top is None or first >= state.num_prompt_tokens:
                continue
            # Position p predicts token p + 1; the last prompt position predicts the first output.
            last = min(first + n, state.num_prompt_tokens - 1)
            if last > first:
                logits = self.model.compute_logits(hidden[start : start + last - first])
                targets = torch.tensor(state.token_ids[first + 1 : last + 1], device=self.device)
                logprobs = torch.log_softmax(logits, dim=-1)
                if self.prompt_logprobs_observer is not None:
                    self.prompt_logprobs_observer(state.request_id, first, logprobs)
                tensors = compute_logprobs_tensors(logprobs, num_top, targets)
                state.prompt_logprobs.extend(_row_logprobs(tensors, i, num_top) for i in range(last - first))
            if first + n >= state.num_prompt_tokens:
                done[state.request_id] = [None, *state.prompt_logprobs]
                state.prompt_logprobs = []
        return done


def _row_logprobs(tensors, row: int, num_top: int) -> TokenLogprobs:
    ids = tensors.token_ids[row, : num_top + 1].tolist()
    values = tensors.logprobs[row, : num_top + 1].tolist()
    return TokenLogprobs(ids, values, int(tensors.ranks[row]))
