"""The live dashboard in a real headless Chromium (Debian's package, `make chromium`): after real traffic
to a real server, the numbers the page shows equal /metrics; a screenshot is kept; it loads no external URL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium")
PROMPT = "The three most useful things to know about paged attention are the block table, the"
# Chromium's own background services (updates, sync): browser traffic, not the page's.
BROWSER_HOSTS = ("google.com", "googleapis.com", "gvt1.com")


def static_text(name: str) -> str:
    return resources.files("threefold.server").joinpath("static", name).read_text()


def test_page_names_no_external_url():
    for name in ("dashboard.html", "dashboard.js", "dashboard_common.js", "dashboard.css"):
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", static_text(name)), name
    vendored = static_text("uPlot.iife.min.js")
    banner_end = vendored.index("*/") + 2 if vendored.startswith("/*") else 0  # licence banner names its home
    assert "http://" not in vendored[banner_end:] and "https://" not in vendored[banner_end:]


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    from threefold.engine.llm_engine import EngineArgs, LLMEngine
    from threefold.kvstore.config import OffloadConfig

    from server_harness import ServerThread

    # An L2 host-memory tier: blocks are written through to it, so the page has a tier's bytes to show.
    engine = LLMEngine(smollm2_fp32, EngineArgs(dtype="float32", kv_cache_memory=16 << 20, max_model_len=256,
                                                kv_offload=OffloadConfig(cpu_bytes=8 << 20)))
    with ServerThread(engine, cost_per_hour=1.0) as server:
        yield server


def chromium(url: str, tmp_path: Path, *args: str) -> str:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-default-apps",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=4000", *args, url]
    result = subprocess.run([CHROMIUM, *flags], capture_output=True, text=True, timeout=120, check=True)
    return result.stdout


def page_numbers(dom: str) -> dict[str, str]:
    return dict(re.findall(r'id="([a-z_-]+)">([^<]*)<', dom))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed: run `make chromium` (make test does)")
def test_dashboard_in_chromium_matches_metrics(server, tmp_path):
    from server_helpers import metrics, wait_for

    for _ in range(3):  # the repeats hit the prefix cache
        response = httpx.post(f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200
    wait_for(lambda: metrics(server.url).get("threefold:ledger_requests_total") == 3)
    wait_for(lambda: metrics(server.url).get("threefold:kv_offload_pending_writes") == 0)  # written through
    page = httpx.get(f"{server.url}/dashboard")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    net_log = tmp_path / "net-log.json"
    dom = chromium(f"{server.url}/dashboard", tmp_path, "--dump-dom", f"--log-net-log={net_log}")
    m = metrics(server.url)
    shown = page_numbers(dom)
    assert int(shown["polls"]) >= 2, "the page never polled /dashboard/data"
    assert float(shown["generation-tokens"]) == m["vllm:generation_tokens_total"] == 24
    assert float(shown["prompt-tokens"]) == m["vllm:prompt_tokens_total"]
    assert float(shown["running"]) == m["vllm:num_requests_running"] == 0
    assert float(shown["waiting"]) == m["vllm:num_requests_waiting"] == 0
    assert shown["kv-usage"] == f'{m["vllm:kv_cache_usage_perc"]:.4f}'
    hit_rate = m["vllm:prefix_cache_hits_total"] / m["vllm:prefix_cache_queries_total"]
    assert hit_rate > 0 and shown["prefix-hit-rate"] == f"{hit_rate:.4f}"
    assert shown["draft-acceptance"] == "-"  # no speculation here: absent, not zero
    assert float(shown["ledger-requests"]) == m["threefold:ledger_requests_total"] == 3
    assert shown["ledger-compute"] == f'{m["threefold:ledger_compute_seconds_total"]:.3f}'
    saved = m["threefold:ledger_saved_seconds_total{technique=prefix_cache}"]
    assert shown["saved-prefix_cache"] == f"prefix_cache {saved:.3f}  " and saved > 0
    tier = "tier=cpu"
    used = m[f"threefold:kv_offload_used_bytes{{{tier}}}"]
    capacity = m[f"threefold:kv_offload_capacity_bytes{{{tier}}}"]
    writes = m[f"threefold:kv_offload_writes_total{{{tier}}}"]
    assert used > 0 and capacity == 8 << 20 and writes > 0
    assert shown["tier-cpu"] == (f"cpu {used / 1048576:.2f}/{capacity / 1048576:.2f} MiB, {writes:g} blocks written, "
                                 f"{m.get(f'threefold:kv_offload_hit_tokens_total{{{tier}}}', 0):g} hit tokens  ")
    # Every URL the browser fetched: this server's, or Chromium's own background services.
    urls = set(re.findall(r'"url":"([^"]+)"', net_log.read_text()))
    page_urls = {u for u in urls if u.startswith(server.url)}
    assert f"{server.url}/dashboard/static/uPlot.iife.min.js" in page_urls
    outside = {u for u in urls - page_urls if not any(h in u.split("/")[2] for h in BROWSER_HOSTS)}
    assert not outside, f"the page loaded external URLs: {sorted(outside)}"
    shot = tmp_path / "dashboard.png"
    chromium(f"{server.url}/dashboard", tmp_path, f"--screenshot={shot}", "--window-size=1280,1000")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"dashboard screenshot: {shot}")


def test_dashboard_data_is_json_of_metrics(server):
    data = httpx.get(f"{server.url}/dashboard/data").json()
    assert json.dumps(data)  # plain JSON, no NaN
    assert data["kv_codec"] == "auto" and set(data["ledger"]["saved_s"]) == {"prefix_cache"}
    assert httpx.get(f"{server.url}/dashboard/static/../app.py").status_code == 404


def test_grafana_dashboard_reads_only_served_metrics(server):
    exposed = set()  # a counter's TYPE line names it with its _total; a histogram's series add _bucket
    for name in re.findall(r"^# TYPE (\S+) \w+", httpx.get(f"{server.url}/metrics").text, re.M):
        exposed |= {name, name + "_bucket"}
    dashboard = json.loads((Path(__file__).parents[1] / "docs/grafana/threefold.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"]
            for m in re.findall(r"(?:vllm|threefold):[a-z_]+", t["expr"])}
    assert "threefold:ledger_saved_seconds_total" in used
    assert used <= exposed, f"not served: {sorted(used - exposed)}"
