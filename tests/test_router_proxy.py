"""The router in front of 2 real in-process `threefold serve` backends, driven by the openai client."""

from __future__ import annotations

import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from threefold.cli import main as cli_main
from threefold.engine.llm_engine import EngineArgs, LLMEngine
from threefold.errors import ThreefoldError
from threefold.router.app import build_app
from threefold.router.config import RouterConfig
from threefold.router.keys import PromptKeyer
from threefold.router.proxy import ProxyConfig, Router

from server_harness import ServerThread, free_port, wait_healthy

MODEL = "smollm2-135m"


RETRY_AFTER_S = 3


def new_engine(weights) -> LLMEngine:
    return LLMEngine(weights, EngineArgs(dtype="float32", max_model_len=512, kv_cache_memory=24 << 20))


@pytest.fixture(scope="module")
def backends(smollm2_fp32):
    with ServerThread(new_engine(smollm2_fp32), retry_after_s=RETRY_AFTER_S) as a, \
            ServerThread(new_engine(smollm2_fp32), retry_after_s=RETRY_AFTER_S) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def keyer() -> PromptKeyer:
    return PromptKeyer(MODEL)


class RouterThread:
    def __init__(self, urls: list[str], policy: str, keyer: PromptKeyer) -> None:
        self.router = Router(urls, policy, RouterConfig(), keyer, ProxyConfig(health_interval_s=0.2))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(build_app(self.router), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RouterThread:
        self.thread.start()
        wait_healthy(self.url, timeout_s=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def state(self) -> dict:
        return httpx.get(f"{self.url}/router/state").json()["backends"]


def prefix_hits(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(s.value for f in families if f.name == "vllm:prefix_cache_hits" for s in f.samples)


def histogram_counts(url: str) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return {f.name: sum(s.value for s in f.samples if s.name.endswith("_count")) for f in families
            if f.type == "histogram"}


def test_bad_cli_input_gets_a_clear_error(capsys):
    assert cli_main(["router"]) == 2
    assert "needs at least one --backend" in capsys.readouterr().err
    assert cli_main(["router", "--backend", "localhost:8001"]) == 2
    assert "is not a base URL" in capsys.readouterr().err
    assert cli_main(["router", "--backend", "http://127.0.0.1:1", "--policy", "fastest"]) == 2
    assert "unknown routing policy 'fastest'" in capsys.readouterr().err
    assert cli_main(["router", "--backend", "http://127.0.0.1:1", "--calibration", "/nonexistent.json"]) == 2
    assert "calibration file /nonexistent.json not found" in capsys.readouterr().err


def test_router_takes_tpct_and_pool_size_from_a_calibration(tmp_path):
    import argparse

    from threefold.router.cli import router_config
    from threefold.sim.engine_model import EngineModel

    path = tmp_path / "engine.json"
    EngineModel({16: 0.05, 2048: 4.096}, 1e-5, block_size=16, num_blocks=300).save(path)
    ns = argparse.Namespace(policy="dualmap", block_size=16, slo=5.0, tpct=None, calibration=str(path))
    config = router_config(ns)
    assert config.tpct_s == pytest.approx(0.002) and config.cache_capacity_blocks == 300 and config.slo_s == 5.0
    assert router_config(argparse.Namespace(**{**vars(ns), "tpct": 0.01})).tpct_s == 0.01
    assert router_config(argparse.Namespace(**{**vars(ns), "block_size": None})).block_size == 16
    with pytest.raises(ThreefoldError, match="--block-size 32 conflicts with the block size 16"):
        router_config(argparse.Namespace(**{**vars(ns), "block_size": 32}))


def test_streaming_non_streaming_models_and_malformed(backends, keyer):
    with RouterThread([b.url for b in backends], "round_robin", keyer) as front:
        client = front.client()
        done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                         temperature=0)
        assert done.usage.completion_tokens == 4 and done.choices[0].text
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                      max_tokens=4, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert [m.id for m in client.models.list().data] == [MODEL]
        counts = histogram_counts(front.url)  # the non-streamed answer is not a TTFT
        assert counts["threefold:router_time_to_first_token_seconds"] == 1
        assert counts["threefold:router_backend_first_token_seconds"] == 1
        assert counts["threefold:router_request_latency_seconds"] == 2
        assert counts["threefold:router_backend_accept_seconds"] == 2
        for body in (b"{bad", b'{"model": "smollm2-135m", "prompt": 5}', b'{"prompt": "x", "max_tokens": -1}'):
            headers = {"content-type": "application/json"}
            direct = httpx.post(f"{backends[0].url}/v1/completions", content=body, headers=headers)
            routed = httpx.post(f"{front.url}/v1/completions", content=body, headers=headers)
            assert routed.status_code == direct.status_code == 400 and routed.json() == direct.json()
        state = front.state()
        assert [s["routed"] for s in state.values()] == [3, 2]  # completion, chat, 3 malformed alternate
        metrics = httpx.get(f"{front.url}/metrics").text
        assert 'threefold:router_requests_total{backend="' in metrics


def test_a_multi_turn_session_lands_where_its_prefix_is_cached(backends, keyer):
    with RouterThread([b.url for b in backends], "dualmap", keyer) as front:
        client = front.client()
        hits_before = [prefix_hits(b.url) for b in backends]
        messages = [{"role": "user", "content": "Write a haiku about the sea, the wind and a lighthouse keeper."}]
        cached = []
        for _ in range(3):
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Another one, please."}]
        routed = {url: s["routed"] for url, s in front.state().items()}
        assert sorted(routed.values()) == [0, 3]  # every turn on one backend
        home = next(i for i, b in enumerate(backends) if routed[b.url] == 3)
        gained = [prefix_hits(b.url) - before for b, before in zip(backends, hits_before, strict=True)]
        assert gained[home] >= 32 and gained[1 - home] == 0 and cached[1] >= 32 and cached[2] > cached[1]


def routed_total(front: RouterThread, url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{front.url}/metrics").text)
    return sum(s.value for f in families if f.name == "threefold:router_requests"
               for s in f.samples if s.labels["backend"] == url and s.name.endswith("_total"))


def test_a_503_with_retry_after_is_honoured_and_the_backend_rejoins(backends, keyer):
    drained, other = backends
    with RouterThread([drained.url, other.url], "round_robin", keyer) as front:
        client = front.client()
        drained.state.draining = True  # a real server shutting down: 503 + Retry-After: 3 on every request
        try:
            refused_at = time.monotonic()  # before the 503 arrives: its Retry-After runs from a moment after this
            client.completions.create(model=MODEL, prompt="One,", max_tokens=2)  # round robin tries `drained` first
            down = front.state()[drained.url]
            assert not down["healthy"] and down["cooling_s"] > RETRY_AFTER_S - 1
            for i in range(3):
                client.completions.create(model=MODEL, prompt=f"Two {i},", max_tokens=2)
            assert routed_total(front, drained.url) == 1 and routed_total(front, other.url) == 4
        finally:
            drained.state.draining = False
        while not front.state()[drained.url]["healthy"]:  # its /health answers 200 again: the probe rejoins it
            assert time.monotonic() - refused_at < 15
            time.sleep(0.05)
        assert time.monotonic() - refused_at >= RETRY_AFTER_S - 0.1  # not before its Retry-After ran out
        for i in range(2):
            client.completions.create(model=MODEL, prompt=f"Three {i},", max_tokens=2)
        assert routed_total(front, drained.url) == 2  # back in the rotation
        retries = httpx.get(f"{front.url}/metrics").text
        assert 'reason="503"' in retries


def stream_text(client: openai.OpenAI, prompt: str, started: threading.Event) -> tuple[str, str | None]:
    """-> (text, error): a cut-off stream must end with an error event, never hang."""
    text = ""
    try:
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
            started.set()
    except openai.APIError as exc:
        return text, str(exc)
    return text, None


# The victim's engine thread may still publish into the event loop its server just closed: the
# crash of a killed process, reported by pytest as an unhandled thread exception, not a router failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dying_backend_ends_its_streams_and_loses_no_unstarted_request(backends, keyer, smollm2_fp32):
    victim = ServerThread(new_engine(smollm2_fp32)).__enter__()
    survivor = backends[0]
    with RouterThread([survivor.url, victim.url], "round_robin", keyer) as front, ThreadPoolExecutor(8) as pool:
        client = front.client()
        events = [threading.Event() for _ in range(4)]
        streams = [pool.submit(stream_text, client, f"Count to one hundred, take {i}:", events[i]) for i in range(4)]
        assert all(e.wait(60) for e in events)
        victim.server.should_exit = victim.server.force_exit = True  # connections are cut, port closed
        victim.thread.join(10)
        victim.state.engine.shutdown()  # the process is "dead": its engine stops with it
        late = [pool.submit(client.completions.create, model=MODEL, prompt=f"Number {i} is", max_tokens=2)
                for i in range(4)]
        assert all(f.result(timeout=60).choices[0].text is not None for f in late)  # re-routed, none lost
        outcomes = [f.result(timeout=60) for f in streams]
        cut = [error for _, error in outcomes if error]
        assert len(cut) == 2 and all("backend serving this stream failed" in e for e in cut)
        assert sum(error is None for _, error in outcomes) == 2
        state = front.state()
        assert not state[victim.url]["healthy"] and state[survivor.url]["healthy"]
        assert state[survivor.url]["routed"] >= 6  # its 2 streams and the 4 late requests


def test_replicas_as_ray_actors(keyer):
    """`threefold cluster --ray`'s path on a local Ray (ray is a test dependency): 2 actors, each owning a
    `threefold serve`, behind the router; stopping them ends the servers."""
    from threefold.router.ray_cluster import start_replicas, stop_replicas

    urls, handles = start_replicas(2, MODEL, ["--kv-cache-memory=24MiB", "--max-model-len=512"], None, 0.5)
    try:
        with RouterThread(urls, "round_robin", keyer) as front:
            client = front.client()
            replies = [client.completions.create(model=MODEL, prompt=f"Hello {i}", max_tokens=2) for i in range(2)]
            assert all(r.usage.completion_tokens == 2 for r in replies)
            state = front.state()
            assert sorted(state) == sorted(urls) and all(s["routed"] == 1 and s["healthy"] for s in state.values())
    finally:
        stop_replicas(handles)
    for url in urls:  # each actor's server went with it
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed: `make chromium`")
def test_router_dashboard_in_chromium_shows_its_replicas(backends, keyer, tmp_path):
    from test_dashboard import BROWSER_HOSTS, chromium

    from server_helpers import metrics

    with RouterThread([b.url for b in backends], "round_robin", keyer) as front:
        client = front.client()
        for i in range(3):
            client.completions.create(model=MODEL, prompt=f"Dashboards, take {i}:", max_tokens=4, temperature=0)
        assert httpx.get(f"{front.url}/dashboard").headers["content-security-policy"].startswith("default-src 'self'")
        net_log = tmp_path / "net-log.json"
        dom = chromium(f"{front.url}/dashboard", tmp_path, "--dump-dom", f"--log-net-log={net_log}")
        shown = dict(re.findall(r'id="([a-z0-9_-]+)">([^<]*)<', dom))
        replicas = [metrics(b.url) for b in backends]
        state = front.state()
        assert int(shown["polls"]) >= 2 and shown["policy"] == "round_robin" and shown["answering"] == "2"
        assert shown["routed"] == "3"
        assert float(shown["generation-tokens"]) == sum(m["vllm:generation_tokens_total"] for m in replicas)
        for i, (backend, m) in enumerate(zip(backends, replicas, strict=True)):
            assert shown[f"r{i}-url"] == backend.url and shown[f"r{i}-healthy"] == "yes"
            assert shown[f"r{i}-routed"] == str(state[backend.url]["routed"])
            assert float(shown[f"r{i}-generation-tokens"]) == m["vllm:generation_tokens_total"]
        urls = set(re.findall(r'"url":"([^"]+)"', net_log.read_text()))
        page_urls = {u for u in urls if u.startswith(front.url)}
        assert f"{front.url}/dashboard/static/uPlot.iife.min.js" in page_urls
        outside = {u for u in urls - page_urls if not any(h in u.split("/")[2] for h in BROWSER_HOSTS)}
        assert not outside, f"the page loaded external URLs: {sorted(outside)}"
        shot = tmp_path / "router_dashboard.png"
        chromium(f"{front.url}/dashboard", tmp_path, f"--screenshot={shot}", "--window-size=1280,900")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"router dashboard screenshot: {shot}")
        assert httpx.get(f"{front.url}/dashboard/static/../app.py").status_code == 404
