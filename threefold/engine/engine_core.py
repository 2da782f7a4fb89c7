"""EngineCore: the step loop (schedule -> execute -> update), nothing about text."""

from __future__ import annotations

import dataclasses
import logging
import time

import psutil

from threefold.config import CacheConfig, SchedulerConfig
from threefold.core.kv_cache_manager import KVCacheManager
from threefold.core.outputs import EngineCoreOutput, ModelRunnerOutput
from threefold.core.request import Request, RequestStatus
from threefold.core.scheduler import Scheduler, SchedulerStats
from threefold.core.step_cost import LinearStepModel
from threefold.engine.step_log import StepLog, wall_time
from threefold.errors import ThreefoldError
from threefold.kv.registry import make_codec
from threefold.kv.window import window_slots
from threefold.kvstore import Namespace, OffloadConfig, TieredKVStore
from threefold.model.loader import LoadedModel
from threefold.spec.config import SpeculativeConfig
from threefold.worker.kv_offload import BlockCodec, KVOffload, prefill_profile
from threefold.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HYBRID_PROFILE_TOKENS = (1, 64, 256)
"""Token counts whose forward time calibrates the hybrid step-time predictor (then refitted online)."""

LOAD_WAIT_S = 0.05
"""How long an engine with nothing to run but prefix reads in flight waits for one before stepping again."""

_DEFAULT_KV_FRACTION = 0.2
_DEFAULT_KV_CAP = 4 << 30


def default_kv_cache_memory() -> int:
    """A safe share of the RAM that is free now, capped: the weights and activations need the rest."""
    return int(min(psutil.virtual_memory().available * _DEFAULT_KV_FRACTION, _DEFAULT_KV_CAP))


class EngineCore:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig, sched: SchedulerConfig,
                 max_model_len: int, device: str = "cpu", speculative: SpeculativeConfig | None = None,
                 offload: OffloadConfig | None = None, step_log: str | None = None) -> None:
        self.step_log = StepLog(step_log) if step_log else None
        self.runner = ModelRunner(loaded, cache.block_size, cache.kv_cache_dtype, device=device,
                                  speculative_config=speculative, max_model_len=max_model_len)
        budget = cache.kv_cache_memory or default_kv_cache_memory()
        window_bytes = self.runner.window_bytes_per_seq()
        plan_bytes = -(-max_model_len // cache.block_size) * self.runner.bytes_per_block()  # one full-length request
        num_windows = window_slots(budget, window_bytes, sched.max_num_seqs, plan_bytes) if window_bytes else 0
        if num_windows:  # a windowed codec (KIVI): the windows come out of the same budget
            sched = dataclasses.replace(sched, max_num_seqs=num_windows)
            logger.info("KV cache: %d full-precision windows of %.1f MiB bound max_num_seqs to %d",
                        num_windows, window_bytes / 2**20, num_windows)
        num_blocks = (budget - num_windows * window_bytes) // self.runner.bytes_per_block() + 1  # +1: the null block
        min_blocks = -(-max_model_len // cache.block_size) + 1
        if num_blocks < min_blocks:
            raise ThreefoldError(
                f"kv_cache_memory={budget} bytes holds {num_blocks - 1} blocks, fewer than the "
                f"{min_blocks - 1} one {max_model_len}-token request needs; raise kv_cache_memory "
                f"or lower max_model_len.", param="kv_cache_memory")
        self.runner.initialize_kv_cache(num_blocks, num_windows)
        spec = self.runner.kv_cache_dtype
        self.offload = self._build_offload(loaded, offload, cache) if offload and offload.enabled else None
        self.kv = KVCacheManager(num_blocks, cache.block_size, loaded.fingerprint, cache.enable_prefix_caching, spec,
                                 record_events=self.offload is not None)
        lookahead = 0 if speculative is None else speculative.num_lookahead_tokens
        self.scheduler = Scheduler(sched, self.kv, max_model_len, num_lookahead_tokens=lookahead,
                                   external=self.offload)
        self.loaded = loaded
        self.cache_info = {"kv_cache_dtype": spec, "block_size": cache.block_size, "num_blocks": num_blocks - 1,
                           "bytes_per_token": self.runner.bytes_per_block() / cache.block_size,
                           "capacity_tokens": self.kv.capacity_tokens, "kv_cache_memory": budget,
                           "window_bytes_per_seq": window_bytes, "max_num_seqs": sched.max_num_seqs}
        """What the KV pool holds (startup log, /metrics, `threefold info`)."""
        if self.runner.codec is None:  # a per-layer mix: each layer's codec (a gauge per layer in /metrics)
            self.cache_info["layer_codecs"] = [str(c.spec) for c in self.runner.codecs]
        logger.info("KV cache: kv_cache_dtype=%s, %.1f bytes/token, %d blocks of %d tokens = %d tokens (%.1f MiB)",
                    spec, self.cache_info["bytes_per_token"], num_blocks - 1,
                    cache.block_size, self.kv.capacity_tokens, budget / 2**20)

    def _build_offload(self, loaded: LoadedModel, config: OffloadConfig, cache: CacheConfig) -> KVOffload:
        """The tiers under the pool; blocks keyed by the weights' fingerprint, codec and block size."""
        runner = self.runner
        assert runner.kv_cache is not None
        if runner.codec is None:
            raise ThreefoldError(f"kv_offload does not support a per-layer codec mix yet (kv_cache_dtype "
                                 f"{runner.kv_cache_dtype}); use one codec for every layer.", param="kv_offload")
        codec = runner.codec if config.codec is None else make_codec(
            config.codec, loaded.config.num_kv_heads, loaded.config.head_dim, loaded.config.dtype)
        namespace = Namespace(loaded.fingerprint, str(codec.spec), cache.block_size)
        block_codec = BlockCodec(runner.kv_cache, codec)  # first: it refuses codecs the tiers cannot move
        offload = KVOffload(TieredKVStore(config, namespace), block_codec, cache.block_size,
                            prefill_profile(loaded.model))
        runner.offload = offload
        logger.info("KV offload: tiers %s, codec %s, %d bytes/block, recompute floor %.3f ms/token",
                    [t.name for t in offload.store.tiers], codec.spec, offload.codec.payload_bytes,
                    offload.token_seconds * 1e3)
        return offload

    def close(self) -> None:
        """Finish the offload tiers' pending writes and release them; close the step log."""
        if self.offload is not None:
            self.offload.close()
        if self.step_log is not None:
            self.step_log.close()

    def add_request(self, request: Request) -> None:
        if request.is_offline and self.scheduler.hybrid and self.scheduler.predictor is None:
            self.scheduler.predictor = self.calibrate_step_model()
        self.scheduler.add_request(request)

    def calibrate_step_model(self) -> LinearStepModel:
        """The hybrid budget's predictor: forwards of a few token counts on this machine (with the
        adaptive speculation profile's points when that pass ran), refitted from every step after.
        Run when the first offline request arrives, so engines without batch work never pay it."""
        from threefold.spec.decoder import profile_step_cost
        from threefold.spec.runner import _dense_forward
        limit = self.scheduler.config.max_num_batched_tokens
        counts = tuple(n for n in HYBRID_PROFILE_TOKENS if n <= limit)
        # Best of two: the first forward of a process pays one-time setup, which a single timing
        # charged to every later step as fixed cost until enough steps were measured.
        cost = profile_step_cost(lambda n: _dense_forward(self.loaded.model, n), counts, repeats=2)
        profile = dict(zip(cost.tokens, cost.seconds, strict=True))
        controller = None if self.runner.spec is None else self.runner.spec.decoder.controller
        if controller is not None:
            profile = dict(zip(controller.cost.tokens, controller.cost.seconds, strict=True)) | profile
        model = LinearStepModel.from_profile(profile)
        logger.info("hybrid scheduling: step-time model calibrated from %s", sorted(profile.items()))
        return model

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_stopped(self, request_ids: list[str]) -> None:
        """Finish requests the engine stopped on text (stop strings)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.runner.execute(sched)  # still drops finished requests' state and does the block I/O
            if self.offload is not None and self.scheduler.loads is not None and self.scheduler.loads.loading:
                self.offload.wait_for_loads(LOAD_WAIT_S)  # nothing else to run: idle until a read is in
            return []
        shape = self._step_shape(sched.num_scheduled_tokens) if self.step_log is not None else []
        start = time.perf_counter()
        try:
            out = self.runner.execute(sched)
            seconds = time.perf_counter() - start
            predictor = self.scheduler.predictor
            if isinstance(predictor, LinearStepModel):
                predictor.observe(self.scheduler.last_shape, seconds)
            if self.step_log is not None:
                self.step_log.record(wall_time(start), seconds, shape)
        except Exception as exc:  # a broken batch fails its requests, not the engine
            logger.exception("model step failed")
            out = ModelRunnerOutput({}, failed={rid: f"{type(exc).__name__}: {exc}"
                                                for rid in sched.num_scheduled_tokens})
        outputs = self.scheduler.update_from_output(sched, out)
        if out.draft_token_ids:
            self.scheduler.update_draft_token_ids(out.draft_token_ids)
        return outputs

    def _step_shape(self, scheduled: dict[str, int]) -> list[tuple[int, int]]:
        """(tokens this step, tokens computed before) per request: what the step log records."""
        requests = self.scheduler.requests
        return [(n, requests[rid].num_computed_tokens) for rid, n in scheduled.items()]

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
