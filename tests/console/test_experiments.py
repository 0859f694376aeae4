"""The console for experiments, in the real browser against the package's `whitney serve` (conftest.py): runs
found by search and status, compared with their curves overlaid; curves smoothed (the EMA charts.js documents),
on a log scale, by wall-clock time; a run's curves as CSV; its configuration and the samples its loop logged;
the playground's two models side by side, and what an answer waits behind while training holds the engine;
base-model names shown whole; the server view's time labels apart. Each check compares what the page shows
with what the API reports for the same run.
"""

from __future__ import annotations

import csv
import re

import httpx
import pytest

from tests.console.conftest import KEY_A, LONG_MODEL, screenshot, sign_in, trainer_of, wait_until
from tests.console.trainer import EXAMPLES
from whitney import Client
from whitney.datums import sft_datum

pytestmark = pytest.mark.usefixtures("console_server")
SECOND_STEPS = 5


@pytest.fixture(scope="module")
def second_run(console_server):
    """A finished run of KEY_A on the long-named model: SECOND_STEPS steps at a constant learning rate with weight
    decay, a logged reward/mean each step (the trainer's run logs one too), tagged experiment=lr-sweep-b."""
    with Client(console_server.url, api_key=KEY_A) as client:
        run = client.create_session(purpose="sweep").create_run(base_model=LONG_MODEL, rank=4, alpha=8.0,
                                                                experiment="lr-sweep-b")
        batch = [sft_datum(p, c) for p, c in EXAMPLES]
        for step in range(1, SECOND_STEPS + 1):
            run.forward_backward(batch, "cross_entropy")
            run.optim_step(learning_rate=1e-3, weight_decay=0.01).result()
            run.log_metrics({"reward/mean": 0.1 * step})
        run.finish()
        return run.id


def api(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY_A}"})


def ema(values: list[float], w: float) -> list[float]:
    """TensorBoard's debiased exponential moving average, written out from the formula the console documents."""
    out, last = [], 0.0
    for n, x in enumerate(values, 1):
        last = w * last + (1 - w) * x
        out.append(last / (1 - w ** n))
    return out


def plotted(page, chart: str) -> dict:
    """What a chart plots now: its x scale, y distribution, x values, and each series' label and values."""
    return page.evaluate("""(id) => {
        const u = document.querySelector(`[data-chart='${id}']`).chart.plot;
        return {time: u.scales.x.time, distr: u.scales.y.distr, xs: Array.from(u.data[0]),
                series: u.series.slice(1).map((s, i) => ({label: s.label, values: Array.from(u.data[i + 1])}))};
    }""", chart)


def series_of(plot: dict, label: str) -> list:
    return next(s["values"] for s in plot["series"] if s["label"] == label)


def set_view(page, **controls) -> None:
    """Move the view controls as a user does (the range input's value, then its input event)."""
    page.evaluate("""(c) => {
        const form = document.getElementById('view');
        if ('smoothing' in c) form.querySelector('#smoothing').value = c.smoothing;
        if ('x' in c) form.querySelector('#x-axis').value = c.x;
        if ('log' in c) form.querySelector('#log-y').checked = c.log;
        form.dispatchEvent(new Event('input', {bubbles: true}));
    }""", controls)


def step_times(operations: list[dict]) -> list[float]:
    """Per optimizer step, when its last forward, forward_backward or optim_step ended (the charts' grouping)."""
    times, step = {}, 1
    for op in sorted(operations, key=lambda o: o["seq_id"]):
        if op["status"] != "succeeded" or op["kind"] not in ("forward", "forward_backward", "optim_step"):
            continue
        times[step] = max(times.get(step, 0.0), op["finished_at"])
        step += op["kind"] == "optim_step"
    return [times[s] for s in sorted(times)]


# ---- the runs list -------------------------------------------------------------------------------------

def test_search_and_status_filter_narrow_the_runs_list(console_server, second_run, page):
    url, trainer = console_server.url, trainer_of(console_server)
    sign_in(page, url, KEY_A)
    page.wait_for_selector(f"tr[data-run='{second_run}']")
    shown = lambda: set(page.locator("tr[data-run]").evaluate_all("rows => rows.map(r => r.dataset.run)"))  # noqa: E731
    assert {trainer.run_id, second_run} <= shown()
    page.fill("#run-search", "SWEEP-b")  # case-insensitive, in the run's metadata
    wait_until(lambda: shown() == {second_run}, timeout=15, what="the search to narrow the list")
    assert "1 run found" in page.inner_text("#found")
    page.fill("#run-search", "sft-demo console-test")  # every word: the run's metadata and its session's
    wait_until(lambda: shown() == {trainer.run_id}, timeout=15, what="a two-word search")
    page.fill("#run-search", "no-such-run")
    page.wait_for_selector("text=No runs match")
    page.fill("#run-search", "")
    page.select_option("#run-status", "finished")
    wait_until(lambda: second_run in shown() and trainer.run_id not in shown(), timeout=15, what="the status filter")
    # The list keeps refreshing under the filter (every 3 s, the filter included).
    page.evaluate("window.__swaps = 0; document.body.addEventListener('htmx:afterSwap', () => window.__swaps++)")
    wait_until(lambda: page.evaluate("window.__swaps") >= 1, timeout=15, what="a refresh")
    assert trainer.run_id not in shown()
    page.select_option("#run-status", "live")
    wait_until(lambda: trainer.run_id in shown() and second_run not in shown(), timeout=15, what="live runs")


def test_base_model_names_are_shown_whole(console_server, second_run, page):
    """A long base-model name wraps in its column (not clipped, not cut with an ellipsis) and is its title too."""
    page.set_viewport_size({"width": 1100, "height": 900})
    sign_in(page, console_server.url, KEY_A)
    cell = page.locator(f"tr[data-run='{second_run}'] td.base-model")
    cell.wait_for()
    box = cell.evaluate("""el => ({scroll: el.scrollWidth, client: el.clientWidth, height: el.clientHeight,
                                   text: el.textContent.trim(), title: el.title})""")
    assert box["text"] == LONG_MODEL and box["title"] == LONG_MODEL
    assert box["scroll"] <= box["client"], box  # nothing overflows the cell
    line = cell.evaluate("el => parseFloat(getComputedStyle(el).lineHeight)")
    assert box["height"] > 1.5 * line, "a name this long wraps onto more lines"
    screenshot(page, "5-runs-search")


# ---- comparing runs -----------------------------------------------------------------------------------

def test_compare_overlays_the_ticked_runs(console_server, second_run, page):
    url, trainer = console_server.url, trainer_of(console_server)
    sign_in(page, url, KEY_A)
    for run_id in (trainer.run_id, second_run):
        page.locator(f"#pick-{run_id}").check()
    # A refresh of the list (every 3 s) keeps the ticks.
    page.evaluate("window.__swaps = 0; document.body.addEventListener('htmx:afterSwap', () => window.__swaps++)")
    wait_until(lambda: page.evaluate("window.__swaps") >= 1, timeout=15, what="a refresh")
    assert page.locator(f"#pick-{trainer.run_id}").is_checked() and page.locator(f"#pick-{second_run}").is_checked()
    page.click("#compare")
    page.wait_for_url(re.compile(r"/console/compare\?run="))
    assert set(page.locator("#compared tr[data-run]").evaluate_all("rs => rs.map(r => r.dataset.run)")) == {
        trainer.run_id, second_run}
    assert "0.001" in page.inner_text(f"#compared tr[data-run='{second_run}']")  # its learning rate
    grad = page.locator("#compare-charts [data-chart='grad_norm']")
    grad.wait_for()
    plot = plotted(page, "grad_norm")
    assert sorted(s["label"] for s in plot["series"]) == sorted([trainer.run_id, second_run]), plot["series"]
    # The second run's series is its own grad norms, by step.
    with api(url) as http:
        ops = http.get(f"/v1/runs/{second_run}/operations").json()
    norms = [op["result"]["metrics"]["grad_norm"] for op in ops if op["kind"] == "optim_step"]
    assert [v for v in series_of(plot, second_run) if v is not None] == norms
    assert plot["xs"][:SECOND_STEPS] == list(range(1, SECOND_STEPS + 1))
    loss_labels = {s["label"] for s in plotted(page, "loss")["series"]}
    assert {trainer.run_id, second_run, f"{trainer.run_id} forward"} == loss_labels
    reward = plotted(page, "logged:reward/mean")
    assert {s["label"] for s in reward["series"]} == {trainer.run_id, second_run}
    assert [v for v in series_of(reward, second_run) if v is not None] == pytest.approx(
        [0.1 * s for s in range(1, SECOND_STEPS + 1)])
    screenshot(page, "6-compare")


# ---- the run page's view: smoothing, log scale, x axis ------------------------------------------------

def test_smoothing_log_scale_and_time_axis(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    wait_until(lambda: len(trainer.rewards) >= 6, timeout=120, what="rewards")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    page.locator("[data-chart='logged:reward']").wait_for()
    with api(url) as http:
        series = http.get(f"/v1/runs/{trainer.run_id}/metrics", params={"name": "reward/mean"}).json()["metrics"]
    logged = dict(zip(series["reward/mean"]["steps"], series["reward/mean"]["values"]))
    raw = plotted(page, "logged:reward")
    assert raw["distr"] == 1 and raw["time"] is False
    assert [s["label"] for s in raw["series"]] == ["mean", "min"]
    assert all(logged[x] == v for x, v in zip(raw["xs"], series_of(raw, "mean")) if x in logged)
    # Smoothing 0.8: the plotted "mean" is the EMA of its raw values, drawn faintly under it.
    set_view(page, smoothing=0.8)
    smooth = plotted(page, "logged:reward")
    assert [s["label"] for s in smooth["series"]] == ["mean (raw)", "mean", "min (raw)", "min"]
    values = series_of(smooth, "mean (raw)")
    assert all(logged[x] == v for x, v in zip(smooth["xs"], values) if x in logged)
    assert series_of(smooth, "mean") == pytest.approx(ema(values, 0.8), rel=1e-12)
    assert series_of(smooth, "mean") != values
    assert page.inner_text("#smoothing-out") == "0.80"
    # Log scale: equal distances per decade.
    set_view(page, smoothing=0, log=True)
    decades = page.evaluate("""() => {
        const u = document.querySelector("[data-chart='loss']").chart.plot;
        return {distr: u.scales.y.distr, d1: u.valToPos(0.01, 'y') - u.valToPos(0.1, 'y'),
                d2: u.valToPos(0.1, 'y') - u.valToPos(1, 'y')};
    }""")
    assert decades["distr"] == 3 and decades["d1"] == pytest.approx(decades["d2"]) and decades["d1"] > 0
    # Wall clock: each step at the time its last operation ended, as the API reports them (but the newest step,
    # which may have gained an operation since the chart's last poll).
    set_view(page, log=False, x="time")
    clock = plotted(page, "loss")
    with api(url) as http:
        times = step_times(http.get(f"/v1/runs/{trainer.run_id}/operations").json())
    assert clock["time"] is True and len(clock["xs"]) >= 3
    assert clock["xs"][:-1] == pytest.approx(times[:len(clock["xs"]) - 1], abs=1e-6)
    labels = page.evaluate("() => document.querySelector(\"[data-chart='loss']\").chart.xTicks.map(t => t[1])")
    assert labels and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", label) for label in labels), labels
    # Elapsed: the same times since the run was created.
    set_view(page, x="elapsed")
    elapsed = plotted(page, "loss")
    created = float(page.get_attribute("#curves", "data-start"))
    assert elapsed["time"] is False
    assert elapsed["xs"][:-1] == pytest.approx([t - created for t in times[:len(elapsed["xs"]) - 1]], abs=1e-6)
    assert page.evaluate("JSON.parse(localStorage.getItem('whitney.console.view')).x") == "elapsed"  # kept
    set_view(page, x="step", smoothing=0.6)
    screenshot(page, "7-run-smoothed")


def test_csv_holds_what_the_api_reports(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    wait_until(lambda: len(trainer.rewards) >= 3, timeout=120, what="rewards")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    with page.expect_download() as download:
        page.click("#csv")
    assert download.value.suggested_filename == f"{trainer.run_id}-curves.csv"
    with open(download.value.path(), newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["source", "seq_id", "step", "name", "value", "time"]
    ops_rows = [r for r in rows if r["source"] != "logged"]
    last_seq = max(int(r["seq_id"]) for r in ops_rows)
    with api(url) as http:
        ops = http.get(f"/v1/runs/{trainer.run_id}/operations").json()
        logged = http.get(f"/v1/runs/{trainer.run_id}/metrics").json()["metrics"]
    expected, step = set(), 1
    for op in ops:
        if op["seq_id"] > last_seq or op["status"] != "succeeded" or op["kind"] not in (
                "forward", "forward_backward", "optim_step"):
            continue
        values = ([("loss", op["result"]["loss"])] if "loss" in op["result"] else []) + list(
            op["result"]["metrics"].items())
        expected |= {(op["kind"], op["seq_id"], step, name, float(v), op["finished_at"]) for name, v in values}
        step += op["kind"] == "optim_step"
    got = {(r["source"], int(r["seq_id"]), int(r["step"]), r["name"], float(r["value"]), float(r["time"]))
           for r in ops_rows}
    assert got == expected
    last_step = max(int(r["step"]) for r in rows if r["source"] == "logged")
    got_logged = {(r["name"], int(r["step"]), float(r["value"])) for r in rows if r["source"] == "logged"}
    assert got_logged == {(name, s, v) for name, series in logged.items()
                          for s, v in zip(series["steps"], series["values"]) if s <= last_step}


# ---- a run's configuration and samples -----------------------------------------------------------------

def test_configuration_panel(console_server, second_run, page):
    url, trainer = console_server.url, trainer_of(console_server)
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{second_run}")
    panel = page.locator("#run-config")
    setting = lambda name, section=None: panel.locator(  # noqa: E731
        f"tr[data-setting='{name}']" + (f"[data-section='{section}']" if section else ""))
    assert setting("base_model").locator("td").nth(1).inner_text() == LONG_MODEL
    assert setting("rank").locator("td").nth(1).inner_text() == "4"
    assert setting("alpha").locator("td").nth(1).inner_text() == "8.0"
    assert setting("targets").locator("td").nth(1).inner_text() == "attention, MLP, unembedding"
    assert setting("loss_fn", "forward_backward").get_attribute("data-latest") == "cross_entropy"
    adam = {name: setting(name, "optim_step").get_attribute("data-latest")
            for name in ("learning_rate", "weight_decay", "beta1", "beta2", "eps", "gradient_clip_norm")}
    assert adam == {"learning_rate": "0.001", "weight_decay": "0.01", "beta1": "0.9", "beta2": "0.95",
                    "eps": "1e-12", "gradient_clip_norm": "0.0"}
    assert f"{SECOND_STEPS} optim_steps" in panel.inner_text()
    assert "range" not in setting("learning_rate", "optim_step").inner_text()  # constant
    # The training run: its learning rate decays, shown as its latest value and range; clipping at 10.
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    lr = setting("learning_rate", "optim_step")
    assert "range" in lr.inner_text() and " values" in lr.inner_text()
    assert setting("gradient_clip_norm", "optim_step").get_attribute("data-latest") == "10.0"
    latest = float(lr.get_attribute("data-latest"))
    with api(url) as http:
        rates = [op["result"]["metrics"]["learning_rate"] for op in http.get(
            f"/v1/runs/{trainer.run_id}/operations").json() if op["kind"] == "optim_step" and op["result"]]
    assert latest in rates and latest < rates[0]
    assert setting("loss_fn", "forward").get_attribute("data-latest") == "cross_entropy"  # the evaluations


def test_sample_table_shows_what_the_loop_logged(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    wait_until(lambda: len(trainer.samples) >= 2, timeout=120, what="two steps of samples")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    table = page.locator("#samples")
    table.wait_for()

    def shown() -> tuple[int, list[dict]]:
        rows = page.locator("#samples tbody tr").evaluate_all("""rows => rows.map(r => ({
            prompt: r.querySelectorAll('.sample-text')[0].textContent,
            completion: r.querySelectorAll('.sample-text')[1].textContent,
            reward: r.querySelector('[data-reward]').dataset.reward,
            tags: Array.from(r.querySelectorAll('.tag')).map(t => t.textContent)}))""")
        return int(page.get_attribute("#samples", "data-step")), rows

    def expected(step: int) -> list[dict]:
        return [{"prompt": s["prompt"], "completion": s["completion"], "reward": repr(s["reward"]),
                 "tags": [f"{k}: {v}" for k, v in s["metadata"].items()]} for s in trainer.samples[step]]

    step, rows = shown()
    assert step in trainer.samples and rows == expected(step)
    older = min(trainer.samples)
    page.select_option("#sample-step", str(older))
    wait_until(lambda: shown()[0] == older, timeout=15, what="the older step's samples")
    assert shown()[1] == expected(older)
    with api(url) as http:
        got = http.get(f"/v1/runs/{trainer.run_id}/samples", params={"step": older}).json()["samples"]
    assert [(s["prompt"], s["completion"], s["reward"]) for s in got] == [
        (s["prompt"], s["completion"], s["reward"]) for s in trainer.samples[older]]
    screenshot(page, "8-run-samples-config")


# ---- the playground -----------------------------------------------------------------------------------

def test_playground_side_by_side(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    version = wait_until(lambda: trainer.versions, timeout=120, what="a sampler version")[0]
    tuned = f"{trainer.run_id}@{version}"
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    page.click("#side-by-side")  # the run page's "Base vs vN": the base model and the newest version
    page.wait_for_url(re.compile(r"/console/playground\?"))
    page.select_option("#model-b", tuned)
    assert page.locator("#model").input_value() == "tiny-llama"
    page.locator("#temperature").fill("0")
    page.locator("#max_tokens").fill("12")
    prompt = "Name three prime numbers."
    page.fill("#prompt", prompt)
    page.keyboard.press("Enter")
    for pane in ("#pane-a", "#pane-b"):
        page.wait_for_selector(f"{pane} .msg.assistant[data-done='true']", timeout=120_000)
    assert page.locator(".msg.error").count() == 0
    a, b = (page.locator(f"{pane}").bounding_box() for pane in ("#pane-a", "#pane-b"))
    assert abs(a["y"] - b["y"]) < 1 and b["x"] >= a["x"] + a["width"] - 1, (a, b)  # side by side
    assert page.inner_text("#pane-b .pane-head") == tuned
    with api(url) as http:
        for pane, model in (("#pane-a", "tiny-llama"), ("#pane-b", tuned)):
            reference = http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "top_p": 0.95,
                "max_tokens": 12}).json()["choices"][0]["message"]["content"]
            assert page.locator(f"{pane} .msg.assistant .bubble").text_content() == reference, model
    screenshot(page, "9-playground-side-by-side")


def test_playground_says_what_the_answer_waits_behind(console_server, page):
    """A long forward_backward holds the engine (two engine calls of 8,192 tokens): the answer's pane says it is
    queued behind it, by count and kind, until its first token; the answer then streams as usual."""
    url = console_server.url
    sign_in(page, url, KEY_A)
    page.add_init_script("""
      window.__waits = [];
      new MutationObserver(() => document.querySelectorAll('.msg.assistant .wait').forEach((w) => {
        if (!w.hidden && w.textContent && window.__waits[window.__waits.length - 1] !== w.textContent)
          window.__waits.push(w.textContent);
      })).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
    """)
    page.goto(f"{url}/console/playground?model=tiny-llama")
    page.locator("#max_tokens").fill("8")
    with Client(url, api_key=KEY_A) as client:
        run = client.create_session(purpose="hold").create_run(rank=4)
        long = [sft_datum([1] + [(7 * i + j) % 40000 + 100 for j in range(400)], [5, 6, 7, 2]) for i in range(40)]
        held = run.forward_backward(long)
        wait_until(lambda: client.request("GET", f"/v1/operations/{held.id}")["status"] == "running", timeout=60,
                   every=0.02, what="the long forward_backward to hold the engine")
        page.fill("#prompt", "Hello?")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
        held.result()
        run.cancel()
    waits = page.evaluate("window.__waits")
    queued = [w for w in waits if (m := re.match(r"Queued behind (\d+) operations? \((.*)\) · \d+ s$", w))
              and int(m.group(1)) >= 1 and "forward_backward running" in m.group(2)]
    assert queued, waits
    assert page.locator(".msg.assistant .wait").is_hidden()  # gone once tokens came
    assert page.locator(".msg.error").count() == 0
    assert int(page.locator(".msg.assistant").get_attribute("data-chunks")) >= 1


# ---- the server view ----------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [600, 1360])
def test_server_view_time_labels_do_not_overlap(console_server, page, width):
    page.set_viewport_size({"width": width, "height": 900})
    sign_in(page, console_server.url, KEY_A)
    page.goto(f"{console_server.url}/console/server")
    wait_until(lambda: int(page.locator("#throughput").get_attribute("data-readings") or 0) >= 3, timeout=30,
               what="throughput readings")
    boxes = page.evaluate("""() => {
        const chart = document.querySelector("[data-chart='throughput']").chart;
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = window.WhitneyCharts.FONT;
        return chart.xTicks.filter(t => t[1]).map(([v, label]) => {
            const x = chart.plot.valToPos(v, 'x'), w = ctx.measureText(label).width;
            return {label, left: x - w / 2, right: x + w / 2};
        });
    }""")
    assert len(boxes) >= 2, boxes
    assert all("\n" not in b["label"] for b in boxes), boxes  # one line: no second row of dates to collide
    for a, b in zip(boxes, boxes[1:]):
        assert b["left"] - a["right"] >= 4, (a, b)
    if width == 600:
        screenshot(page, "4b-server-narrow")
