/* Whitney console: the run page's live curves and the server page's throughput chart (charts.js draws them).
 *
 * Curves: the page polls GET <run>/curves?after=<last seq_id> and receives each new succeeded forward,
 * forward_backward and optim_step ({seq, kind, t, loss, metrics}); operations of a run end in seq_id
 * order, so asking after the last one seen never misses one. Points are grouped by optimizer step (the
 * step a forward_backward's gradient goes into); a run with no optim_step is drawn per operation.
 *
 * Logged metrics: the same poll brings the points the run's loop logged (POST /v1/runs/{id}/metrics) after
 * the last id seen ({id, name, step, value, t}; a point logged again comes back under a new id and replaces
 * the old value). They are drawn by their own step, one chart per name, or one per prefix where several
 * names share it ("reward/mean" and "reward/min": the chart "reward", series "mean" and "min").
 */
(function () {
  "use strict";

  const W = window.WhitneyCharts;
  const POLL_MS = 1500;

  /* Logged names grouped into charts: [{id, title, names}], one per name or per shared prefix, names sorted. */
  function loggedGroups(logged) {
    const groups = new Map();
    Array.from(logged.keys()).sort().forEach((name) => {
      const cut = name.lastIndexOf("/");
      const key = cut > 0 ? name.slice(0, cut) : name;
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(name);
    });
    return Array.from(groups, ([key, names]) => ({ id: "logged:" + key, key: key, names: names,
                                                   title: names.length > 1 ? key : names[0] }));
  }

  function startCurves(root) {
    const grid = document.getElementById("charts");
    const empty = document.getElementById("charts-empty");
    const state = document.getElementById("curves-state");
    const start = Number(root.dataset.start);
    const charts = new Map();
    const points = [];
    let after = -1;
    const loggedBox = document.getElementById("logged");
    const loggedGrid = document.getElementById("logged-charts");
    const logged = new Map();  // name -> Map(step -> {value, t})
    let loggedAfter = -1;

    function chart(container, id, title) {
      if (!charts.has(id)) charts.set(id, new W.Chart(container, id, title));
      const c = charts.get(id);
      c.setTitle(title);  // "reward/mean" becomes "reward" once "reward/min" comes
      return c;
    }

    function draw() {
      const mode = W.view.x;
      const g = W.group(points);
      const rows = g.rows;
      const x = { mode: mode, label: W.xLabel(mode, g.byStep ? "step" : "seq_id"),
                  values: W.xOf(mode, rows.map((r) => r.x), rows.map((r) => r.t), start) };
      W.chartsOf(g).forEach((c) => chart(grid, c.id, c.title).update(x, c.series));
      loggedGroups(logged).forEach((c) => {
        const shared = c.names.length > 1;
        const series = W.align(c.names.map((name, i) => {
          const s = W.loggedSeries(logged, name);
          return { label: shared ? name.slice(c.key.length + 1) : name, color: W.PALETTE[i % W.PALETTE.length],
                   xs: W.xOf(mode, s.steps, s.times, start), values: s.values };
        }));
        chart(loggedGrid, c.id, c.title).update({ mode: mode, label: W.xLabel(mode, "step"), values: series.xs }, series.series);
      });
      if (loggedBox) loggedBox.hidden = logged.size === 0;
      empty.hidden = Array.from(charts.keys()).some((k) => !k.startsWith("logged:"));
      root.dataset.points = String(points.length);
    }

    async function poll() {
      let live = true;
      try {
        const body = await W.fetchCurves(root.dataset.url, after, loggedAfter);
        if (body === null) return;
        live = body.live;
        body.points.forEach((p) => points.push(p));
        if (body.points.length) after = body.points[body.points.length - 1].seq;
        body.logged.forEach((p) => {
          if (!logged.has(p.name)) logged.set(p.name, new Map());
          logged.get(p.name).set(p.step, { value: p.value, t: p.t });
        });
        if (body.logged.length) loggedAfter = body.logged[body.logged.length - 1].id;
        if (body.points.length || body.logged.length) draw();
        state.className = live ? "livedot" : "livedot off";
        state.textContent = live ? "live" : "run " + body.status;
        if (body.points.length >= 5000 || body.logged.length >= 5000) return poll();  // more to read at once
      } catch (e) {
        state.className = "livedot off";
        state.textContent = "reconnecting…";
      }
      if (live) setTimeout(poll, POLL_MS);
    }

    W.bindControls(document.getElementById("view"), draw);
    poll();
  }

  function startThroughput(root) {
    const chart = new W.Chart(document.getElementById("throughput-plot"), "throughput", "Tokens per second", "time");
    async function poll() {
      try {
        const r = await fetch(root.dataset.url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
        if (r.status === 401) { window.location.reload(); return; }
        const s = await r.json();
        chart.update({ mode: "time", label: "time", values: s.t }, [
          { label: "training", color: W.COLORS.train, fill: "rgba(79,70,229,.07)", values: s.training },
          { label: "sampled", color: W.COLORS.other, fill: "rgba(13,148,136,.07)", values: s.sampling },
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
