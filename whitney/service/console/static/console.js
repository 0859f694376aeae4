/* Whitney console: the run page's live curves and the server page's throughput chart (uPlot).
 *
 * Curves: the page polls GET <run>/curves?after=<last seq_id> and receives each new succeeded forward,
 * forward_backward and optim_step ({seq, kind, t, loss, metrics}); operations of a run end in seq_id
 * order, so asking after the last one seen never misses one. Points are grouped by optimizer step (the
 * step a forward_backward's gradient goes into); a run with no optim_step is drawn per operation.
 *
 * Logged metrics: the same poll brings the points the run's loop logged (POST /v1/runs/{id}/metrics) after
 * the last id seen ({id, name, step, value}; a point logged again comes back under a new id and replaces
 * the old value). They are drawn by their own step, one chart per name, or one per prefix where several
 * names share it ("reward/mean" and "reward/min": the chart "reward", series "mean" and "min").
 */
(function () {
  "use strict";

  const COLORS = { train: "#4f46e5", eval: "#f59e0b", other: "#0d9488", second: "#db2777" };
  const POLL_MS = 1500;

  function fmt(x) {
    if (x == null || !isFinite(x)) return "—";
    if (Math.abs(x) >= 1e5) return Math.round(x).toLocaleString();
    if (x !== 0 && Math.abs(x) < 1e-3) return x.toExponential(2);
    return String(Number(x.toPrecision(4)));
  }

  /* A tick label with as many decimals as the ticks' increment needs (so 0.004998 and 0.004999 differ). */
  function tick(v, incr) {
    if (v == null) return "";
    const decimals = Math.max(0, -Math.floor(Math.log10(incr || 1) + 1e-9));
    if (decimals > 6) return v === 0 ? "0" : v.toExponential(Math.max(1, Math.min(4, decimals - Math.floor(-Math.log10(Math.abs(v) || 1)))));
    if (Math.abs(v) >= 1e5) return Math.round(v).toLocaleString();
    return v.toFixed(decimals);
  }

  /* A y axis whose width fits its longest tick label. */
  function yAxis(label) {
    return Object.assign(axisStyle(label), {
      values: (u, splits, axis, space, incr) => splits.map((v) => tick(v, incr)),
      size: (u, values) => Math.max(40, 14 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))),
    });
  }

  const STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000];

  function axisStyle(label) {
    return { stroke: "#808898", grid: { stroke: "#eef0f3", width: 1 }, ticks: { stroke: "#e4e7ec", width: 1 },
             font: "11px Inter, system-ui, sans-serif", label: label, labelFont: "11px Inter, system-ui, sans-serif",
             labelSize: label ? 16 : 0 };
  }

  /* One chart: a card cell holding a uPlot instance, rebuilt when its set of series changes. */
  function Chart(container, id, title, time) {
    const cell = document.createElement("div");
    cell.className = "chart";
    cell.dataset.chart = id;
    cell.innerHTML = '<div class="chart-title"><b></b><span class="last"></span></div><div class="plot"></div>';
    cell.querySelector("b").textContent = title;
    container.appendChild(cell);
    this.cell = cell;
    this.plotEl = cell.querySelector(".plot");
    this.plot = null;
    this.signature = "";
    this.time = !!time;  // x in Unix seconds (the throughput chart), else steps or seq_ids
  }

  Chart.prototype.update = function (xLabel, xs, series) {
    const signature = xLabel + "|" + series.map((s) => s.label).join("|");
    const data = [xs].concat(series.map((s) => s.values));
    const n = xs.length;
    const chart = this;
    this.series = series;
    this.xLabel = xLabel;
    if (signature !== this.signature || !this.plot) {
      if (this.plot) this.plot.destroy();
      this.plotEl.innerHTML = "";
      const opts = {
        width: Math.max(200, this.plotEl.clientWidth), height: 190,
        legend: { show: false },
        cursor: { drag: { x: true, y: false }, points: { size: 7 } },
        scales: { x: this.time ? { time: true, range: (u, min, max) => [Math.min(min, max - 120), max] } : { time: false } },
        axes: [this.time ? axisStyle("") : Object.assign(axisStyle(xLabel), { incrs: STEPS }), yAxis("")],
        series: [{ label: xLabel }].concat(series.map((s) => ({
          label: s.label, stroke: s.color, width: 2, spanGaps: true, fill: s.fill,
          points: { show: !this.time && n <= 60, size: 5, fill: s.color },
        }))),
        hooks: { setCursor: [(u) => chart.caption(u.cursor.idx)] },
      };
      this.plot = new uPlot(opts, data, this.plotEl);
      this.signature = signature;
    } else {
      this.plot.setData(data);
    }
    this.caption(this.plot.cursor.idx);
    this.cell.dataset.points = String(series.reduce((k, s) => k + s.values.filter((v) => v != null).length, 0));
  };

  /* The title's legend: each series' value at the hovered point, else its last value. */
  Chart.prototype.caption = function (idx) {
    const box = this.cell.querySelector(".last");
    box.textContent = "";
    const hovered = idx != null && idx >= 0;
    if (hovered && this.plot) {
      const at = document.createElement("span");
      at.className = "at";
      const x = this.plot.data[0][idx];
      at.textContent = this.time ? new Date(x * 1000).toLocaleTimeString() : this.xLabel + " " + x;
      box.appendChild(at);
    }
    (this.series || []).forEach((s) => {
      const item = document.createElement("span");
      const mark = document.createElement("i");
      mark.style.background = s.color;
      item.appendChild(mark);
      const value = hovered ? s.values[idx] : lastValue(s.values);
      item.appendChild(document.createTextNode((this.series.length > 1 ? s.label + " " : "") + fmt(value)));
      box.appendChild(item);
    });
  };

  Chart.prototype.resize = function () {
    if (this.plot) this.plot.setSize({ width: Math.max(200, this.plotEl.clientWidth), height: 190 });
  };

  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  }

  /* Group operation points by step: train (forward_backward) and eval (forward) sums and token-weighted
     means, and each optim_step's metrics. */
  function group(points) {
    const byStep = !!points.find((p) => p.kind === "optim_step");
    const rows = new Map();
    let step = 1;
    points.forEach((p, i) => {
      const x = byStep ? step : p.seq;
      if (!rows.has(x)) rows.set(x, { x: x, train: null, eval: null, optim: null });
      const row = rows.get(x);
      if (p.kind === "optim_step") {
        row.optim = p.metrics;
        step += 1;
        return;
      }
      const side = p.kind === "forward_backward" ? "train" : "eval";
      const acc = row[side] || (row[side] = { loss: 0, tokens: 0, sums: {}, means: {}, weights: {} });
      const tokens = p.metrics["tokens:sum"];
      acc.loss += p.loss || 0;
      acc.tokens += tokens || 0;
      acc.counted = acc.counted || !tokens;
      Object.entries(p.metrics).forEach(([k, v]) => {
        if (k === "loss:sum" || k === "tokens:sum") return;
        if (k.endsWith("sum")) acc.sums[k] = (acc.sums[k] || 0) + v;
        else {
          const w = tokens || 1;
          acc.means[k] = (acc.means[k] || 0) + v * w;
          acc.weights[k] = (acc.weights[k] || 0) + w;
        }
      });
    });
    return { byStep: byStep, rows: Array.from(rows.values()).sort((a, b) => a.x - b.x) };
  }

  function perToken(acc) { return acc == null ? null : (acc.tokens && !acc.counted ? acc.loss / acc.tokens : acc.loss); }
  function metricOf(acc, k) {
    if (acc == null) return null;
    if (k in acc.sums) return acc.sums[k];
    if (k in acc.means) return acc.means[k] / acc.weights[k];
    return null;
  }

  /* The charts to draw from grouped rows: [{id, title, series: [{label, color, values}]}]. */
  function chartsOf(g) {
    const rows = g.rows;
    const out = [];
    const hasTrain = rows.some((r) => r.train), hasEval = rows.some((r) => r.eval), hasOptim = rows.some((r) => r.optim);
    const sides = [];
    if (hasTrain) sides.push(["train", "train", COLORS.train]);
    if (hasEval) sides.push(["eval", "forward", COLORS.eval]);
    if (sides.length) {
      out.push({ id: "loss", title: "Loss per token", series: sides.map(([k, label, color]) => ({ label, color, values: rows.map((r) => perToken(r[k])) })) });
    }
    if (hasOptim) {
      out.push({ id: "grad_norm", title: "Gradient norm (before clipping)", series: [{ label: "grad norm", color: COLORS.other, values: rows.map((r) => (r.optim ? r.optim.grad_norm : null)) }] });
      const lr = [{ label: "learning rate", color: COLORS.train, values: rows.map((r) => (r.optim ? r.optim.learning_rate : null)) }];
      if (rows.some((r) => r.optim && r.optim.learning_rate_lora_B != null && r.optim.learning_rate_lora_B !== r.optim.learning_rate)) {
        lr.push({ label: "LoRA B", color: COLORS.second, values: rows.map((r) => (r.optim ? r.optim.learning_rate_lora_B : null)) });
      }
      out.push({ id: "learning_rate", title: "Learning rate", series: lr });
    }
    if (hasTrain) {
      out.push({ id: "tokens", title: "Tokens per step", series: [{ label: "tokens", color: COLORS.other, values: rows.map((r) => (r.train && !r.train.counted ? r.train.tokens : null)) }] });
    }
    const keys = new Set();
    rows.forEach((r) => ["train", "eval"].forEach((k) => { if (r[k]) Object.keys(r[k].sums).concat(Object.keys(r[k].means)).forEach((m) => keys.add(m)); }));
    Array.from(keys).sort().forEach((m) => {
      out.push({ id: "m:" + m, title: m, series: sides.map(([k, label, color]) => ({ label, color, values: rows.map((r) => metricOf(r[k], m)) })) });
    });
    const optimKeys = new Set();
    rows.forEach((r) => { if (r.optim) Object.keys(r.optim).forEach((k) => optimKeys.add(k)); });
    ["grad_norm", "learning_rate", "learning_rate_lora_B", "step"].forEach((k) => optimKeys.delete(k));
    Array.from(optimKeys).sort().forEach((m) => {
      out.push({ id: "o:" + m, title: m, series: [{ label: m, color: COLORS.other, values: rows.map((r) => (r.optim ? r.optim[m] : null)) }] });
    });
    return out.filter((c) => c.series.some((s) => s.values.some((v) => v != null)));
  }

  const PALETTE = ["#4f46e5", "#0d9488", "#f59e0b", "#db2777", "#2563eb", "#65a30d", "#9333ea", "#dc2626"];

  /* Logged series grouped into charts: [{id, title, xs, series: [{label, color, values}]}], names sorted. */
  function loggedCharts(logged) {
    const groups = new Map();
    Array.from(logged.keys()).sort().forEach((name) => {
      const cut = name.lastIndexOf("/");
      const key = cut > 0 ? name.slice(0, cut) : name;
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(name);
    });
    const out = [];
    groups.forEach((names, key) => {
      const steps = new Set();
      names.forEach((n) => logged.get(n).forEach((v, step) => steps.add(step)));
      const xs = Array.from(steps).sort((a, b) => a - b);
      const shared = names.length > 1;
      out.push({
        id: "logged:" + key, title: shared ? key : names[0], xs: xs,
        series: names.map((n, i) => ({
          label: shared ? n.slice(key.length + 1) : n, color: PALETTE[i % PALETTE.length],
          values: xs.map((x) => (logged.get(n).has(x) ? logged.get(n).get(x) : null)),
        })),
      });
    });
    return out;
  }

  function startCurves(root) {
    const grid = document.getElementById("charts");
    const empty = document.getElementById("charts-empty");
    const state = document.getElementById("curves-state");
    const charts = new Map();
    const points = [];
    let after = -1;
    const loggedBox = document.getElementById("logged");
    const loggedGrid = document.getElementById("logged-charts");
    const logged = new Map();  // name -> Map(step -> value)
    let loggedAfter = -1;

    function drawLogged() {
      loggedCharts(logged).forEach((c) => {
        if (!charts.has(c.id)) charts.set(c.id, new Chart(loggedGrid, c.id, c.title));
        const chart = charts.get(c.id);
        chart.cell.querySelector(".chart-title b").textContent = c.title;  // "reward/mean" becomes "reward"
        chart.update("step", c.xs, c.series);
      });
      if (loggedBox) loggedBox.hidden = logged.size === 0;
    }

    function draw() {
      const g = group(points);
      const xLabel = g.byStep ? "step" : "seq_id";
      const xs = g.rows.map((r) => r.x);
      chartsOf(g).forEach((c) => {
        if (!charts.has(c.id)) charts.set(c.id, new Chart(grid, c.id, c.title));
        charts.get(c.id).update(xLabel, xs, c.series);
      });
      empty.hidden = Array.from(charts.keys()).some((k) => !k.startsWith("logged:"));
      root.dataset.points = String(points.length);
    }

    async function poll() {
      let live = true;
      try {
        const r = await fetch(root.dataset.url + "?after=" + after + "&logged_after=" + loggedAfter, { headers: { Accept: "application/json" }, credentials: "same-origin" });
        if (r.status === 401) { window.location.reload(); return; }
        if (!r.ok) throw new Error("HTTP " + r.status);
        const body = await r.json();
        live = body.live;
        if (body.points.length) {
          body.points.forEach((p) => points.push(p));
          after = body.points[body.points.length - 1].seq;
          draw();
        }
        if (body.logged.length) {
          body.logged.forEach((p) => {
            if (!logged.has(p.name)) logged.set(p.name, new Map());
            logged.get(p.name).set(p.step, p.value);
          });
          loggedAfter = body.logged[body.logged.length - 1].id;
          drawLogged();
        }
        state.className = live ? "livedot" : "livedot off";
        state.textContent = live ? "live" : "run " + body.status;
        if (body.points.length >= 5000 || body.logged.length >= 5000) return poll();  // more to read at once
      } catch (e) {
        state.className = "livedot off";
        state.textContent = "reconnecting…";
      }
      if (live) setTimeout(poll, POLL_MS);
    }

    window.addEventListener("resize", () => charts.forEach((c) => c.resize()));
    poll();
  }

  function startThroughput(root) {
    const chart = new Chart(document.getElementById("throughput-plot"), "throughput", "Tokens per second", true);
    window.addEventListener("resize", () => chart.resize());
    async function poll() {
      try {
        const r = await fetch(root.dataset.url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
        if (r.status === 401) { window.location.reload(); return; }
        const s = await r.json();
        chart.update("time", s.t, [
          { label: "training", color: COLORS.train, fill: "rgba(79,70,229,.07)", values: s.training },
          { label: "sampled", color: COLORS.other, fill: "rgba(13,148,136,.07)", values: s.sampling },
        ]);
        root.dataset.readings = String(s.t.length);
      } catch (e) { /* the next poll retries */ }
      setTimeout(poll, 2000);
    }
    poll();
  }

  function start() {
    const curves = document.getElementById("curves");
    if (curves) startCurves(curves);
    const throughput = document.getElementById("throughput");
    if (throughput) startThroughput(throughput);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
