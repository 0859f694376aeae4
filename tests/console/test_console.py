"""The web console in a real browser (Debian's Chromium through Playwright) against a real `whitney serve`
with API keys on, while a run of KEY_A trains through the HTTP API in a background thread.

What must hold: a wrong key sees nothing and is told so; the loss curve gains points while the page is
watched (no reload), and so does the chart of the reward the loop logs; the timeline shows the operations
as they run; the checkpoints download, export and delete from their buttons; the playground streams a chat
completion token by token (and its text is the endpoint's own answer); the server view shows the loaded model
and the live run. Each page is screenshotted into build/console-screenshots/ for review.
"""

from __future__ import annotations

import io
import tarfile

import httpx
import pytest

from tests.console.conftest import KEY_A, KEY_B, screenshot, sign_in, trainer_of, wait_until

pytestmark = pytest.mark.usefixtures("console_server")


# ---- keys: what the gate lets through, over plain HTTP ------------------------------------------

def test_console_checks_keys_itself(console_server):
    """Static files are open; pages go to the sign-in form; data needs a valid key; changes need htmx."""
    url, run_id = console_server.url, trainer_of(console_server).run_id
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/console/static/console.css").status_code == 200
        assert http.get("/console/static/vendor/uPlot-1.6.32.iife.min.js").status_code == 200
        page = http.get("/console/", headers={"Accept": "text/html"})
        assert page.status_code == 303 and page.headers["location"].startswith("/console/login")
        assert http.get("/console/login").status_code == 200
        for path in ("/console/parts/sessions", f"/console/runs/{run_id}/curves", "/console/server/throughput",
                     f"/console/runs/{run_id}", "/console/playground"):
            for headers in ({}, {"Authorization": "Bearer tml-wrong"}, {"Cookie": "whitney_console_session=tml-wrong"}):
                r = http.get(path, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.json()["code"] == "unauthorized"
        # The run is KEY_A's: KEY_B gets a 404, as from the API.
        other = http.get(f"/console/runs/{run_id}/curves", headers={"Authorization": f"Bearer {KEY_B}"})
        assert other.status_code == 404
        mine = http.get(f"/console/runs/{run_id}/curves", headers={"Authorization": f"Bearer {KEY_A}"})
        assert mine.status_code == 200 and mine.json()["status"] == "active"
        # A change without htmx's header (a cross-site form could send the cookie, not the header) is refused.
        state = wait_until(lambda: trainer_of(console_server).state_id, what="a saved state")
        r = http.delete(f"/console/checkpoints/{state}", headers={"Authorization": f"Bearer {KEY_A}"})
        assert r.status_code == 409 and r.json()["field"] == "hx-request"
        assert http.get(f"/v1/checkpoints/{state}", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
        # Wrong key at the form: 401 and the form again, no cookie.
        r = http.post("/console/login", data={"key": "tml-wrong", "next": "/console/"})
        assert r.status_code == 401 and "not valid" in r.text
        assert "whitney_console_session" not in r.headers.get("set-cookie", "")


def test_wrong_key_sees_nothing(console_server, page):
    url, run_id = console_server.url, trainer_of(console_server).run_id
    sign_in(page, url, "tml-not-a-key")
    assert "/console/login" in page.url
    assert page.get_by_role("alert").inner_text().startswith("This key is not valid")
    assert run_id not in page.content()
    screenshot(page, "0-sign-in-refused")
    # A stale cookie (a key revoked since) goes back to the form, saying why.
    page.context.add_cookies([{"name": "whitney_console_session", "value": "tml-revoked", "url": url}])
    page.goto(f"{url}/console/runs/{run_id}")
    assert "/console/login" in page.url and "no longer valid" in page.get_by_role("alert").inner_text()
    # Another valid key sees none of KEY_A's objects.
    page.context.clear_cookies()
    sign_in(page, url, KEY_B)
    page.wait_for_selector("text=No sessions yet")
    assert run_id not in page.content()
    page.goto(f"{url}/console/runs/{run_id}")
    assert "does not exist" in page.inner_text("main") and page.locator("#curves").count() == 0


def test_sessions_list(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    sign_in(page, url, KEY_A)
    page.wait_for_selector(f"tr[data-run='{trainer.run_id}']")
    row = page.locator(f"tr[data-run='{trainer.run_id}']")
    assert "active" in row.inner_text() and "tiny-llama" in row.inner_text()
    assert page.locator(f"[data-session='{trainer.session_id}']").count() == 1
    steps_before = int(row.locator("td").nth(4).inner_text())
    # The list refreshes in place (htmx): the step count rises without a reload.
    page.evaluate("window.__same_page = true")
    wait_until(lambda: int(page.locator(f"tr[data-run='{trainer.run_id}'] td").nth(4).inner_text()) > steps_before,
               timeout=30, what="the steps column to rise")
    assert page.evaluate("window.__same_page") is True
    screenshot(page, "1-sessions")


def test_run_page_curves_and_timeline_update_live(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    wait_until(lambda: trainer.versions, timeout=120, what="a first sampler version")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    page.evaluate("window.__same_page = true")
    loss = page.locator("[data-chart='loss']")
    loss.wait_for()
    first = int(wait_until(lambda: loss.get_attribute("data-points"), what="loss points"))
    assert first >= 1
    for chart in ("grad_norm", "learning_rate"):
        assert int(page.locator(f"[data-chart='{chart}']").get_attribute("data-points")) >= 1
    # The curve gains points while we watch: the training thread adds a step every ~0.3 s.
    gained = wait_until(lambda: int(loss.get_attribute("data-points")) >= first + 3
                        and loss.get_attribute("data-points"), timeout=60, what="the loss curve to gain points")
    assert int(gained) >= first + 3
    # The points are the run's losses (loss per token of each step), not made up: the latest shown value is
    # one the API reported for this run.
    shown = page.evaluate("""() => Array.from(document.querySelectorAll("[data-chart='loss'] .last span"))
                                     .map(s => s.textContent)""")
    assert shown and any(s.startswith("train ") for s in shown)
    # The timeline lists the operations, newest first, and moves too.
    rows = page.locator("#timeline tr[data-op]")
    kinds = set(page.locator("#timeline tr[data-op] td:nth-child(2) .mono").all_inner_texts())
    assert {"forward_backward", "optim_step"} <= kinds, kinds
    top = int(rows.first.locator("td").first.inner_text())
    wait_until(lambda: int(page.locator("#timeline tr[data-op]").first.locator("td").first.inner_text()) > top,
               timeout=30, what="the timeline to show newer operations")
    assert page.locator("#timeline .badge.succeeded").count() > 0
    # Sampler versions and the saved state are listed.
    page.wait_for_selector("#versions tr[data-version]")
    page.wait_for_selector(f"#checkpoints tr[data-package='{trainer.state_id}']")
    assert page.evaluate("window.__same_page") is True, "the page reloaded"
    screenshot(page, "2-run")


def test_run_page_charts_the_metrics_the_loop_logs(console_server, page):
    """The trainer logs reward/mean and reward/min each step (POST /v1/runs/{id}/metrics): one "reward" chart
    with both series, gaining points while watched, its points the ones the API returns."""
    url, trainer = console_server.url, trainer_of(console_server)
    wait_until(lambda: len(trainer.rewards) >= 2, timeout=120, what="logged rewards")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    page.evaluate("window.__same_page = true")
    reward = page.locator("#logged [data-chart='logged:reward']")
    reward.wait_for()
    assert page.locator("#logged").is_visible()
    assert reward.locator(".chart-title b").inner_text() == "reward"
    first = int(wait_until(lambda: reward.get_attribute("data-points"), what="reward points"))
    assert first >= 2 and first % 2 == 0, first  # mean and min at each step
    labels = page.evaluate("""() => Array.from(document.querySelectorAll("[data-chart='logged:reward'] .last span"))
                                      .map(s => s.textContent)""")
    assert any(t.startswith("mean ") for t in labels) and any(t.startswith("min ") for t in labels), labels
    gained = int(wait_until(lambda: int(reward.get_attribute("data-points")) >= first + 6
                            and reward.get_attribute("data-points"), timeout=60,
                            what="the reward chart to gain points"))
    # What the chart holds is what the run logged: the API's series, by optimizer step (1, 2, 3...).
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        series = http.get(f"/v1/runs/{trainer.run_id}/metrics").json()["metrics"]
    assert set(series) == {"reward/mean", "reward/min"}
    steps = series["reward/mean"]["steps"]
    assert steps[:3] == [1, 2, 3] and gained <= 2 * len(steps)
    assert all(lo <= mean <= 1.0 for lo, mean in zip(series["reward/min"]["values"], series["reward/mean"]["values"]))
    logged = {step: mean for step, mean, _ in trainer.rewards}
    assert all(logged[s] == v for s, v in zip(steps, series["reward/mean"]["values"]) if s in logged)
    # The caption's latest mean is one the API holds (shown to 4 significant digits).
    shown = page.evaluate("""() => Array.from(document.querySelectorAll("[data-chart='logged:reward'] .last span"))
                                     .map(s => s.textContent).find(t => t.startsWith("mean "))""")
    value = float(shown.split()[1])
    assert any(abs(v - value) <= 1e-3 * abs(v) for v in series["reward/mean"]["values"]), (shown, series)
    assert page.evaluate("window.__same_page") is True, "the page reloaded"
    screenshot(page, "2b-run-logged-metrics")


def test_checkpoint_download_export_delete(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    state = wait_until(lambda: trainer.state_id, timeout=120, what="a saved state")
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{trainer.run_id}")
    row = page.locator(f"#checkpoints tr[data-package='{state}']")
    row.wait_for()
    # Download: the package as a tar archive, through the signed-in cookie.
    with page.expect_download() as download:
        row.get_by_text("Download").click()
    with tarfile.open(fileobj=io.BytesIO(open(download.value.path(), "rb").read())) as tar:
        names = tar.getnames()
    assert any(n.endswith("whitney_state.json") for n in names)
    assert any(n.endswith("adapter.safetensors") for n in names)
    # Export: a new lora package written from the state, listed at once.
    row.get_by_text("Export").click()
    exported = page.locator("#checkpoints tr[data-kind='lora']")
    exported.first.wait_for(timeout=60_000)
    lora_id = exported.first.get_attribute("data-package")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60) as http:
        package = http.get(f"/v1/checkpoints/{lora_id}").json()
        assert (package["kind"], package["run_id"], package["name"]) == ("lora", trainer.run_id, "checkpoint-v1")
        archive = http.get(f"/v1/checkpoints/{lora_id}/archive")
        with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
            files = {n.rsplit("/", 1)[-1] for n in tar.getnames()}
        assert files >= {"adapter_config.json", "adapter_model.safetensors"}
        # Delete (confirmed in the dialog): gone from the page and from the API.
        page.once("dialog", lambda dialog: dialog.accept())
        page.locator(f"#checkpoints tr[data-package='{lora_id}']").get_by_text("Delete").click()
        page.locator(f"#checkpoints tr[data-package='{lora_id}']").wait_for(state="detached")
        assert http.get(f"/v1/checkpoints/{lora_id}").status_code == 404
        assert http.get(f"/v1/checkpoints/{state}").status_code == 200  # the state itself is untouched


def test_playground_streams_a_completion(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    version = wait_until(lambda: trainer.versions, timeout=120, what="a sampler version")[0]
    model = f"{trainer.run_id}@{version}"
    sign_in(page, url, KEY_A)
    # Record every change of the answer's text, with the time, and when it was done.
    page.add_init_script("""
      window.__states = []; window.__doneAt = null;
      new MutationObserver(() => {
        const a = document.querySelector('.msg.assistant');
        if (!a) return;
        const text = a.querySelector('.bubble').textContent;
        const last = window.__states[window.__states.length - 1];
        if (text && (!last || last.text !== text)) window.__states.push({text, t: performance.now()});
        if (a.dataset.done && window.__doneAt === null) window.__doneAt = performance.now();
      }).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
    """)
    page.goto(f"{url}/console/playground?model={model}")
    assert page.locator("#model").input_value() == model
    page.locator("#temperature").fill("0")  # greedy: the answer is then the endpoint's one answer
    page.locator("#max_tokens").fill("24")
    page.fill("#prompt", "Write a short poem about gradient descent.")
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
    assert page.locator(".msg.error").count() == 0, page.locator(".msg.error").inner_text()
    states = page.evaluate("window.__states")
    done_at = page.evaluate("window.__doneAt")
    streamed = [s for s in states if s["t"] <= done_at]
    assert len(streamed) >= 3, f"the answer appeared in {len(streamed)} steps, not streamed: {states}"
    assert all(b["text"].startswith(a["text"]) for a, b in zip(streamed, streamed[1:])), "chunks must append"
    answer = page.locator(".msg.assistant .bubble").text_content()
    assert int(page.locator(".msg.assistant").get_attribute("data-chunks")) >= 3
    assert page.locator(".msg.assistant").get_attribute("data-finish") in ("stop", "length")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120) as http:
        reference = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Write a short poem about gradient descent."}],
            "temperature": 0, "top_p": 0.95, "max_tokens": 24}).json()
    assert answer == reference["choices"][0]["message"]["content"]
    screenshot(page, "3-playground")


def test_server_view(console_server, page):
    url, trainer = console_server.url, trainer_of(console_server)
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/server")
    card = page.locator("[data-model='tiny-llama']")
    card.wait_for()
    text = card.inner_text()
    assert "cpu" in text and "float32" in text and "llama" in text and "MB" in text
    assert int(page.locator("#stat-live-runs").inner_text()) >= 1
    # Throughput: readings accumulate (every 2 s) and the training rate is not zero while the run trains.
    wait_until(lambda: int(page.locator("#throughput").get_attribute("data-readings") or 0) >= 3, timeout=30,
               what="throughput readings")
    rate = wait_until(lambda: (t := page.locator("#stat-train-rate").inner_text().split("tok/s")[0].strip()) not in
                      ("—", "0") and t, timeout=30, what="a training rate")
    assert float(rate.replace(",", "")) > 0
    assert trainer.error is None
    screenshot(page, "4-server")


def test_timeline_shows_a_failed_operation_with_its_field_and_datum(console_server, page, monkeypatch):
    """A Tinker SDK run whose forward_backward fails in its turn (a bad second datum): the timeline names the
    error's code, field and datum index."""
    import numpy as np
    import tinker
    from tinker import types

    url = console_server.url
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    service = tinker.ServiceClient()
    training = service.create_lora_training_client(base_model="tiny-llama", rank=4).result()
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 17, 250, 4000]),
                       loss_fn_inputs={"target_tokens": np.array([17, 250, 4000, 12], dtype=np.int64)})
    bad = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),  # 5 targets for 3 tokens
                      loss_fn_inputs={"target_tokens": np.array([6, 7, 8, 9, 10], dtype=np.int64)})
    with pytest.raises(tinker.RequestFailedError):
        training.forward_backward([good, bad], "cross_entropy").result()
    sign_in(page, url, KEY_A)
    page.goto(f"{url}/console/runs/{training.model_id}")
    failed = page.locator("#timeline tr[data-status='failed']")
    failed.wait_for()
    text = failed.inner_text()
    assert "forward_backward" in text and "invalid_input" in text, text
    assert "field target_tokens" in text and "datum 1" in text, text
    assert page.locator("#run-live .tile").nth(4).locator(".value").inner_text() == "1"
