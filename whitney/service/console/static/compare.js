/* Whitney console: runs compared (GET /console/compare?run=A&run=B...). Each run's curves are read as its run
 * page reads them (GET <run>/curves after the last seq_id and logged id seen, again every 2 s while the run is
 * live), and every chart is overlaid: one series per run, in the run's colour, labelled with its id (a run's
 * second series of a chart, such as its forward loss beside its training loss, dashed and named). Logged
 * metrics get a chart per name. The view controls (smoothing, log scale, x axis) apply to all of them; on the
 * step axis runs line up by optimizer step, on "elapsed" by the time since each run was created.
 */
(function () {
  "use strict";

  const W = window.WhitneyCharts;
  const POLL_MS = 2000;

  function start() {
    const root = document.getElementById("compare-charts");
    if (!root) return;
    const grid = document.getElementById("charts");
    const loggedGrid = document.getElementById("logged-charts");
    const runs = JSON.parse(root.dataset.runs).map((r) => Object.assign(r, {
      points: [], logged: new Map(), after: -1, loggedAfter: -1, live: true }));
    const charts = new Map();

    function collect(mode) {
      const out = new Map();  // chart id -> {title, series: [{label, color, dash, xs, values}]}
      const entry = (id, title) => out.get(id) || out.set(id, { title: title, series: [] }).get(id);
      runs.forEach((run) => {
        const g = W.group(run.points);
        const xs = W.xOf(mode, g.rows.map((r) => r.x), g.rows.map((r) => r.t), run.start);
        W.chartsOf(g).forEach((c) => c.series.forEach((s, i) => entry(c.id, c.title).series.push({
          label: i ? run.id + " " + s.label : run.id, color: run.color, dash: i ? [5, 4] : undefined, xs: xs, values: s.values })));
        Array.from(run.logged.keys()).sort().forEach((name) => {
          const s = W.loggedSeries(run.logged, name);
          entry("logged:" + name, name).series.push({ label: run.id, color: run.color, xs: W.xOf(mode, s.steps, s.times, run.start), values: s.values });
        });
      });
      return out;
    }

    function draw() {
      const mode = W.view.x;
      collect(mode).forEach((c, id) => {
        const logged = id.startsWith("logged:");
        if (!charts.has(id)) {
          charts.set(id, new W.Chart(logged ? loggedGrid : grid, id, c.title));
          charts.get(id).named = true;
        }
        const aligned = W.align(c.series);
        charts.get(id).update({ mode: mode, label: W.xLabel(mode, "step"), values: aligned.xs }, aligned.series);
      });
      document.getElementById("logged").hidden = !Array.from(charts.keys()).some((k) => k.startsWith("logged:"));
      root.dataset.loaded = String(runs.filter((r) => r.loaded).length);
    }

    async function read(run) {
      for (;;) {
        const body = await W.fetchCurves(run.url, run.after, run.loggedAfter);
        if (body === null) return;
        run.live = body.live;
        body.points.forEach((p) => run.points.push(p));
        if (body.points.length) run.after = body.points[body.points.length - 1].seq;
        body.logged.forEach((p) => {
          if (!run.logged.has(p.name)) run.logged.set(p.name, new Map());
          run.logged.get(p.name).set(p.step, { value: p.value, t: p.t });
        });
        if (body.logged.length) run.loggedAfter = body.logged[body.logged.length - 1].id;
        if (body.points.length < 5000 && body.logged.length < 5000) break;  // else more to read at once
      }
      run.loaded = true;
    }

    async function poll() {
      try {
        await Promise.all(runs.filter((r) => r.live).map(read));
        draw();
      } catch (e) { /* the next poll retries */ }
      if (runs.some((r) => r.live)) setTimeout(poll, POLL_MS);
    }

    W.bindControls(document.getElementById("view"), draw);
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
