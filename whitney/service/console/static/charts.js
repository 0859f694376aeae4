/* Whitney console charts (uPlot), shared by console.js (a run's curves, the server's throughput) and compare.js
 * (runs overlaid). Every chart of a page follows one view, set by the page's view controls and kept in the
 * browser (localStorage):
 *
 * Smoothing: TensorBoard's debiased exponential moving average, per series over its points in x order (missing
 * points skipped). With weight w in [0, 1): last_0 = 0, last_n = w * last_(n-1) + (1 - w) * x_n, and the plotted
 * value is s_n = last_n / (1 - w^n), so the first point is plotted as it is and w = 0 changes nothing. A smoothed
 * series is drawn over its raw values, drawn faintly.
 * Log scale: the y axis in powers of ten (uPlot's distr 3); values <= 0 are left out there.
 * x axis: "step" (the optimizer step; seq_id for a run without optim_step), "time" (the wall clock: when each
 * step's last operation ended, or a metric was logged), "elapsed" (that time since the run was created).
 */
window.WhitneyCharts = (function () {
  "use strict";

  const FONT = "11px Inter, system-ui, sans-serif";
  const COLORS = { train: "#4f46e5", eval: "#f59e0b", other: "#0d9488", second: "#db2777" };
  const PALETTE = ["#4f46e5", "#0d9488", "#f59e0b", "#db2777", "#2563eb", "#65a30d", "#9333ea", "#dc2626"];
  const STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000];
  const SECONDS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400,
                   172800, 604800];
  const HEIGHT = 190;

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

  const pad = (n) => String(n).padStart(2, "0");

  /* A wall-clock tick, one line: 14:05:30 under a minute apart, 14:05 under a day, else 12/5. */
  function clock(v, incr) {
    const d = new Date(v * 1000);
    if (incr >= 86400) return (d.getMonth() + 1) + "/" + d.getDate();
    const hm = pad(d.getHours()) + ":" + pad(d.getMinutes());
    return incr < 60 ? hm + ":" + pad(d.getSeconds()) : hm;
  }

  /* Seconds as 45s, 3m 05s, 2h 10m. */
  function duration(v) {
    if (v == null) return "";
    const s = Math.round(v);
    if (Math.abs(s) < 60) return s + "s";
    if (Math.abs(s) < 3600) return Math.floor(s / 60) + "m " + pad(s % 60) + "s";
    return Math.floor(s / 3600) + "h " + pad(Math.floor((s % 3600) / 60)) + "m";
  }

  /* The debiased EMA described above; null where a value is missing. */
  function smooth(values, w) {
    if (!(w > 0)) return values.slice();
    let last = 0, n = 0;
    return values.map((v) => {
      if (v == null || !isFinite(v)) return null;
      last = w * last + (1 - w) * v;
      n += 1;
      return last / (1 - Math.pow(w, n));
    });
  }

  function faded(hex) {
    const n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + ",0.28)";
  }

  // ---- the view: every chart of the page follows it --------------------------------------------------

  const KEY = "whitney.console.view";
  const view = { smoothing: 0, log: false, x: "step" };
  try {  // what this browser chose last, where it is still a valid choice
    const kept = JSON.parse(localStorage.getItem(KEY) || "{}");
    if (kept.smoothing >= 0 && kept.smoothing < 1) view.smoothing = Number(kept.smoothing);
    if (["step", "time", "elapsed"].includes(kept.x)) view.x = kept.x;
    view.log = kept.log === true;
  } catch (e) { /* no storage, or not ours: the defaults */ }
  const charts = [];

  /* The page's view controls (#view: #smoothing, #x-axis, #log-y): show the view; on a change, `redraw()` (the
     page gives its charts their x values in the new mode), by default every chart as it is. */
  function bindControls(form, redraw) {
    if (!form) return;
    const smoothing = form.querySelector("#smoothing"), out = form.querySelector("#smoothing-out");
    const axis = form.querySelector("#x-axis"), log = form.querySelector("#log-y");
    smoothing.value = view.smoothing;
    axis.value = view.x;
    log.checked = view.log;
    const show = () => { out.textContent = Number(view.smoothing).toFixed(2); form.dataset.x = view.x; };
    show();
    form.addEventListener("input", () => {
      view.smoothing = Number(smoothing.value);
      view.x = axis.value;
      view.log = log.checked;
      try { localStorage.setItem(KEY, JSON.stringify(view)); } catch (e) { /* not kept */ }
      show();
      if (redraw) redraw();
      else charts.forEach((c) => c.redraw());
    });
  }

  // ---- one chart -----------------------------------------------------------------------------------

  /* A card cell holding a uPlot instance, rebuilt when its axes or set of series change. `fixed`: an x mode this
     chart always uses, and then the view's smoothing and log scale do not apply (the throughput chart). The
     cell keeps its Chart (`cell.chart`), so a test reads what is plotted. */
  function Chart(container, id, title, fixed) {
    const cell = document.createElement("div");
    cell.className = "chart";
    cell.dataset.chart = id;
    cell.innerHTML = '<div class="chart-title"><b></b><span class="last"></span></div><div class="plot"></div>';
    cell.querySelector("b").textContent = title;
    container.appendChild(cell);
    cell.chart = this;
    this.cell = cell;
    this.plotEl = cell.querySelector(".plot");
    this.plot = null;
    this.signature = "";
    this.fixed = fixed || null;
    this.named = false;  // name a lone series in the caption too (compare: it is a run)
    this.source = null;  // what update() was given, for redrawing under another view
    charts.push(this);
  }

  Chart.prototype.setTitle = function (title) { this.cell.querySelector(".chart-title b").textContent = title; };

  /* x: {mode, label, values}; series: [{label, color, values, fill?, dash?}], values aligned with x.values. */
  Chart.prototype.update = function (x, series) {
    this.source = { x: x, series: series };
    this.redraw();
  };

  Chart.prototype.redraw = function () {
    if (!this.source) return;
    const x = this.source.x;
    const w = this.fixed ? 0 : view.smoothing, log = !this.fixed && view.log;
    const order = x.values.map((v, i) => i).filter((i) => x.values[i] != null);
    order.sort((a, b) => x.values[a] - x.values[b]);
    const xs = order.map((i) => x.values[i]);
    this.series = this.source.series.map((s) => {
      const raw = order.map((i) => (s.values[i] == null || (log && s.values[i] <= 0) ? null : s.values[i]));
      return { label: s.label, color: s.color, fill: s.fill, dash: s.dash, raw: raw, values: smooth(raw, w) };
    });
    const smoothed = w > 0;
    const data = [xs];
    const opts = [{ label: x.label }];
    this.series.forEach((s) => {
      if (smoothed) {
        data.push(s.raw);
        opts.push({ label: s.label + " (raw)", stroke: faded(s.color), width: 1, spanGaps: true, dash: s.dash, points: { show: false } });
      }
      data.push(s.values);
      opts.push({ label: s.label, stroke: s.color, width: 2, spanGaps: true, fill: s.fill, dash: s.dash,
                  points: { show: x.mode !== "time" && x.mode !== "elapsed" && xs.length <= 60, size: 5, fill: s.color } });
    });
    const signature = [x.mode, x.label, log, smoothed].concat(opts.map((o) => o.label)).join("|");
    if (signature !== this.signature || !this.plot) {
      if (this.plot) this.plot.destroy();
      this.plotEl.innerHTML = "";
      const chart = this;
      this.plot = new uPlot({
        width: Math.max(200, this.plotEl.clientWidth), height: HEIGHT,
        legend: { show: false },
        cursor: { drag: { x: true, y: false }, points: { size: 7 } },
        scales: { x: xScale(x.mode), y: log ? { distr: 3 } : {} },
        axes: [xAxis(this, x), yAxis()],
        series: opts,
        hooks: { setCursor: [(u) => chart.caption(u.cursor.idx)] },
      }, data, this.plotEl);
      this.signature = signature;
    } else {
      this.plot.setData(data);
    }
    this.caption(this.plot.cursor.idx);
    this.cell.dataset.points = String(this.series.reduce((k, s) => k + s.values.filter((v) => v != null).length, 0));
  };

  function xScale(mode) {
    if (mode !== "time") return { time: false };
    return { time: true, range: (u, min, max) => [Math.min(min, max - 120), max] };  // at least two minutes
  }

  function axisStyle(label) {
    return { stroke: "#808898", grid: { stroke: "#eef0f3", width: 1 }, ticks: { stroke: "#e4e7ec", width: 1 },
             font: FONT, label: label, labelFont: FONT, labelSize: label ? 16 : 0 };
  }

  /* The x axis: steps at round increments, or times on one line each with room between them (a time label is
     at most 8 characters, about 50 px, and ticks are at least 80 px apart). Each draw's ticks are kept on the
     chart (`xTicks`: [value, label]) for the tests that check the labels do not overlap. */
  function xAxis(chart, x) {
    const record = (splits, labels) => { chart.xTicks = splits.map((v, i) => [v, labels[i]]); return labels; };
    if (x.mode === "time") {
      return Object.assign(axisStyle(""), { space: 80, values: (u, splits, ax, space, incr) => record(splits, splits.map((v) => clock(v, incr))) });
    }
    if (x.mode === "elapsed") {
      return Object.assign(axisStyle(x.label), { space: 70, incrs: SECONDS, values: (u, splits) => record(splits, splits.map(duration)) });
    }
    return Object.assign(axisStyle(x.label), { space: 50, incrs: STEPS, values: (u, splits) => record(splits, splits.map((v) => String(v))) });
  }

  /* A y axis whose width fits its longest tick label. */
  function yAxis() {
    return Object.assign(axisStyle(""), {
      values: (u, splits, axis, space, incr) => splits.map((v) => (u.scales.y.distr === 3 ? fmt(v) : tick(v, incr))),
      size: (u, values) => Math.max(40, 14 + 7 * Math.max(0, ...(values || []).map((v) => String(v).length))),
    });
  }

  /* The title's legend: each series' value at the hovered point, else its last value. */
  Chart.prototype.caption = function (idx) {
    const box = this.cell.querySelector(".last");
    box.textContent = "";
    const hovered = idx != null && idx >= 0;
    const x = this.source.x;
    if (hovered && this.plot) {
      const at = document.createElement("span");
      at.className = "at";
      const v = this.plot.data[0][idx];
      at.textContent = x.mode === "time" ? new Date(v * 1000).toLocaleTimeString() : x.mode === "elapsed" ? duration(v) : x.label + " " + v;
      box.appendChild(at);
    }
    (this.series || []).forEach((s) => {
      const item = document.createElement("span");
      const mark = document.createElement("i");
      mark.style.background = s.color;
      item.appendChild(mark);
      const value = hovered ? s.values[idx] : lastValue(s.values);
      item.appendChild(document.createTextNode((this.named || this.series.length > 1 ? s.label + " " : "") + fmt(value)));
      box.appendChild(item);
    });
  };

  Chart.prototype.resize = function () {
    if (this.plot) this.plot.setSize({ width: Math.max(200, this.plotEl.clientWidth), height: HEIGHT });
  };

  window.addEventListener("resize", () => charts.forEach((c) => c.resize()));

  function lastValue(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] != null) return values[i];
    return null;
  }

  // ---- a run's points, grouped into charts ------------------------------------------------------

  /* Group operation points ({seq, kind, t, loss, metrics}) by step: train (forward_backward) and eval (forward)
     sums and token-weighted means, and each optim_step's metrics; `t`: when the step's last operation ended. */
  function group(points) {
    const byStep = !!points.find((p) => p.kind === "optim_step");
    const rows = new Map();
    let step = 1;
    points.forEach((p) => {
      const x = byStep ? step : p.seq;
      if (!rows.has(x)) rows.set(x, { x: x, t: null, train: null, eval: null, optim: null });
      const row = rows.get(x);
      row.t = Math.max(row.t || 0, p.t || 0) || null;
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

  /* The charts to draw from grouped rows: [{id, title, series: [{label, color, values}]}], values by row. */
  function chartsOf(g) {
    const rows = g.rows;
    const out = [];
    const hasTrain = rows.some((r) => r.train), hasEval = rows.some((r) => r.eval), hasOptim = rows.some((r) => r.optim);
    const sides = [];
    if (hasTrain) sides.push(["train", "train", COLORS.train]);
    if (hasEval) sides.push(["eval", "forward", COLORS.eval]);
    if (sides.length) {
      out.push({ id: "loss", title: "Loss per target position (summed loss / positions, weight 0 included)", series: sides.map(([k, label, color]) => ({ label, color, values: rows.map((r) => perToken(r[k])) })) });
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

  /* Logged metrics (name -> Map(step -> {value, t})) as a run's series by name: {steps, times, values}. */
  function loggedSeries(logged, name) {
    const points = Array.from(logged.get(name).entries()).sort((a, b) => a[0] - b[0]);
    return { steps: points.map((p) => p[0]), times: points.map((p) => p[1].t), values: points.map((p) => p[1].value) };
  }

  /* The x values of rows (or logged points) in the view's mode: steps, times, or times since `start`. */
  function xOf(mode, steps, times, start) {
    if (mode === "time") return times;
    if (mode === "elapsed") return times.map((t) => (t == null ? null : t - start));
    return steps;
  }

  function xLabel(mode, stepLabel) {
    return mode === "time" ? "time" : mode === "elapsed" ? "elapsed" : stepLabel;
  }

  /* Series with their own x values ([{label, color, xs, values}]) on one x: the union of theirs, sorted; null
     where a series has no point. */
  function align(series) {
    const all = Array.from(new Set([].concat(...series.map((s) => s.xs.filter((x) => x != null))))).sort((a, b) => a - b);
    const at = new Map(all.map((x, i) => [x, i]));
    return {
      xs: all,
      series: series.map((s) => {
        const values = all.map(() => null);
        s.xs.forEach((x, i) => { if (x != null) values[at.get(x)] = s.values[i]; });
        return { label: s.label, color: s.color, dash: s.dash, values: values };
      }),
    };
  }

  /* GET a run's curves after the given seq_id and logged id, with the console's key (its cookie). */
  async function fetchCurves(url, after, loggedAfter) {
    const r = await fetch(url + "?after=" + after + "&logged_after=" + loggedAfter, { headers: { Accept: "application/json" }, credentials: "same-origin" });
    if (r.status === 401) { window.location.reload(); return null; }
    if (!r.ok) throw new Error("HTTP " + r.status);
    return r.json();
  }

  return { COLORS, PALETTE, FONT, view, fmt, smooth, Chart, bindControls, group, chartsOf, loggedSeries, xOf, xLabel,
           align, fetchCurves };
})();
