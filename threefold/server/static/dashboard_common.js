// What the server's and the router's dashboards share: number cells by element id, and uPlot charts
// that keep the last HISTORY polls. Loaded before each page's own script (classic scripts share globals).
"use strict";
const HISTORY = 300;
const colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];

function text(value, digits) {
  if (value === null || value === undefined) return "-";
  return digits === undefined ? String(value) : value.toFixed(digits);
}

function show(id, value, digits) { document.getElementById(id).textContent = text(value, digits); }

function makeChart(title, names) {
  const box = document.createElement("div");
  box.className = "chart";
  document.getElementById("charts").appendChild(box);
  const series = [{}].concat(names.map((n, i) => ({label: n, stroke: colors[i % colors.length], width: 2})));
  const data = [[]].concat(names.map(() => []));
  return {plot: new uPlot({title, width: 420, height: 200, series}, data, box), data};
}

function push(chart, t, values) {
  chart.data[0].push(t);
  values.forEach((v, i) => chart.data[i + 1].push(v === null || v === undefined ? null : v));
  if (chart.data[0].length > HISTORY) chart.data.forEach(column => column.shift());
  chart.plot.setData(chart.data);
}
