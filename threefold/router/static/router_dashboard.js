// The router's live dashboard: polls /dashboard/data every second; cluster totals and one row per replica
// go into elements with ids (what the browser test reads); uPlot draws the last few minutes per replica
// (helpers: the server's dashboard_common.js).
"use strict";
const charts = [
  {title: "output tokens/s, per replica", pick: (b, prev, dt) =>
    b.replica && prev && prev.replica ? (b.replica.generation_tokens - prev.replica.generation_tokens) / dt : null},
  {title: "requests in flight (router's count), per replica", pick: b => b.in_flight === undefined ? null : b.in_flight},
  {title: "prefix hit rate, per replica", pick: b => b.replica ? b.replica.prefix_hit_rate : null},
];
let last = null, polls = 0, names = null;

function row(b, i) {
  const r = b.replica || {};
  const id = "r" + i + "-";
  const cells = [["url", b.url], ["healthy", b.healthy ? "yes" : "no"], ["routed", text(b.routed)],
    ["in-flight", text(b.in_flight)], ["queued", text(b.queued)], ["running", text(r.running)],
    ["waiting", text(r.waiting)], ["kv-usage", text(r.kv_usage, 4)], ["prefix-hit-rate", text(r.prefix_hit_rate, 4)],
    ["generation-tokens", text(r.generation_tokens)]];
  const tr = document.createElement("tr");
  if (!b.healthy) tr.className = "down";
  cells.forEach(([key, value]) => {
    const td = document.createElement("td");
    td.id = id + key;
    td.textContent = value;
    tr.appendChild(td);
  });
  return tr;
}

function update(d) {
  const t = d.totals;
  const dt = last ? Math.max(d.time - last.time, 1e-3) : null;
  polls += 1;
  show("policy", d.policy); show("answering", d.replicas_answering); show("polls", polls);
  show("routed", t.routed); show("generation-tokens", t.generation_tokens); show("prompt-tokens", t.prompt_tokens);
  show("throughput", last ? (t.generation_tokens - last.totals.generation_tokens) / dt : 0, 1);
  show("running", t.running); show("waiting", t.waiting); show("prefix-hit-rate", t.prefix_hit_rate, 4);
  const body = document.getElementById("replicas");
  body.replaceChildren(...d.backends.map(row));
  if (names === null) {
    names = d.backends.map(b => b.url.replace(/^https?:\/\//, ""));
    charts.forEach(c => { c.chart = makeChart(c.title, names); });
  }
  const previous = last ? Object.fromEntries(last.backends.map(b => [b.url, b])) : {};
  charts.forEach(c => push(c.chart, d.time, d.backends.map(b => c.pick(b, previous[b.url], dt))));
  last = d;
}

async function poll() {
  try {
    const response = await fetch("/dashboard/data", {cache: "no-store"});
    if (response.ok) update(await response.json());
  } catch (err) {
    document.getElementById("polls").textContent = "error: " + err;
  }
}

poll();
setInterval(poll, 1000);
