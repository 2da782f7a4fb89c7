// The live dashboard: polls /dashboard/data every second, writes the latest numbers into elements with ids
// (what the browser test reads) and plots the last few minutes with uPlot (helpers: dashboard_common.js).
// Loads nothing from elsewhere.
"use strict";
const charts = [
  {title: "throughput (output tokens/s)", series: ["tok/s"], pick: (d, rate) => [rate]},
  {title: "requests", series: ["running", "waiting"], pick: d => [d.running, d.waiting]},
  {title: "KV use (fraction of the pool)", series: ["kv"], pick: d => [d.kv_usage]},
  {title: "prefix hit rate / draft acceptance", series: ["prefix hits", "draft acceptance"],
   pick: d => [d.prefix_hit_rate, d.draft_acceptance]},
];
const TIERS = ["cpu", "disk", "redis"];
let savingsChart = null, tierChart = null, last = null, polls = 0;

function update(d) {
  const rate = last ? (d.generation_tokens - last.generation_tokens) / Math.max(d.time - last.time, 1e-3) : 0;
  last = d;
  polls += 1;
  show("model", d.model); show("kv-codec", d.kv_codec); show("polls", polls);
  show("generation-tokens", d.generation_tokens); show("prompt-tokens", d.prompt_tokens);
  show("throughput", rate, 1); show("running", d.running); show("waiting", d.waiting);
  show("kv-usage", d.kv_usage, 4); show("prefix-hit-rate", d.prefix_hit_rate, 4);
  show("draft-acceptance", d.draft_acceptance, 4);
  charts.forEach(c => push(c.chart, d.time, c.pick(d, rate)));
  showTiers(d.kv_tiers || {}, d.time);
  if (!d.ledger) return;
  show("ledger-requests", d.ledger.requests); show("ledger-compute", d.ledger.compute_s, 3);
  const names = Object.keys(d.ledger.saved_s);
  const savings = document.getElementById("savings");
  savings.textContent = names.length ? "saved compute, s: " : "no technique that saves compute runs here";
  names.forEach(n => {
    const el = document.createElement("span");
    el.id = "saved-" + n.replace(/[^a-z0-9_-]/gi, "_");
    el.textContent = n + " " + d.ledger.saved_s[n].toFixed(3) + "  ";
    savings.appendChild(el);
  });
  if (names.length && !savingsChart) savingsChart = makeChart("ledger: compute saved (s), by technique", names);
  if (savingsChart) push(savingsChart, d.time, names.map(n => d.ledger.saved_s[n]));
}

function showTiers(tiers, time) {
  // One line per KV offload tier: what it holds of its size, blocks written, prompt tokens it served.
  const names = Object.keys(tiers).sort();
  const box = document.getElementById("tiers");
  box.textContent = names.length ? "KV tiers: " : "no KV offload tier";
  names.forEach(n => {
    const t = tiers[n], el = document.createElement("span");
    el.id = "tier-" + n.replace(/[^a-z0-9_-]/gi, "_");
    const used = t.used_bytes === undefined ? "?" : (t.used_bytes / 1048576).toFixed(2);
    el.textContent = n + " " + used + "/" + ((t.capacity_bytes || 0) / 1048576).toFixed(2) + " MiB, "
      + (t.writes || 0) + " blocks written, " + (t.hit_tokens || 0) + " hit tokens  ";
    box.appendChild(el);
  });
  if (names.length && !tierChart) tierChart = makeChart("KV tiers: bytes held (MiB)", TIERS);
  if (tierChart) push(tierChart, time, TIERS.map(n => tiers[n] && tiers[n].used_bytes !== undefined
    ? tiers[n].used_bytes / 1048576 : null));
}

async function poll() {
  try {
    const response = await fetch("/dashboard/data", {cache: "no-store"});
    if (response.ok) update(await response.json());
  } catch (err) {
    document.getElementById("polls").textContent = "error: " + err;
  }
}

charts.forEach(c => { c.chart = makeChart(c.title, c.series); });
poll();
setInterval(poll, 1000);
