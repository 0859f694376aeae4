"""Idle runs paged out behind a real server: the same numbers as a server that never pages, and the
residency shown in /v1/training/capabilities ("runs") and /metrics (whitney_runs_in_memory / _paged_out)."""

from __future__ import annotations

import argparse
import time

import pytest

from tests.engine.test_paging import DAMAGES
from tests.service.test_flow import LORA, expect, sft_batch, until
from tests.service.test_metrics import scrape, value
from whitney import Client
from whitney.cli import add_engine_flags, engine_config
from whitney.protocol.config import EngineConfig

IDLE = 0.5  # seconds untouched before a run is paged out


def _runs(http) -> dict:
    return expect(http.get("/v1/training/capabilities"), 200)["runs"]


def _train(server, paged: bool) -> list:
    """A short loop: every operation's numbers; on the paging server each starts on a paged-out run."""
    http = server.http()
    run = Client(server.url).create_session().create_run(**LORA, seed=3)
    prompt = [1, 523, 1077, 33]
    out = []

    def step(operation):
        if paged:
            until(lambda: _runs(http)["paged_out"] == 1, 30, "the idle run paged out")
            files = list((server.config.data_dir / "paged").glob("engine-*/run-*"))
            moments = [f for f in files if f.name.endswith(".moments.bin")]  # once the run has stepped
            assert len(files) - len(moments) == 1 and len(moments) <= 1, files
            assert all(f.stat().st_size > 0 for f in files), files
            m = scrape(http)
            assert value(m, "whitney_runs_paged_out") == 1 and value(m, "whitney_runs_in_memory") == 0
        out.append(operation())

    for _ in range(2):
        step(lambda: run.forward_backward(sft_batch()).result())
        step(lambda: run.optim_step(learning_rate=1e-2).result()["metrics"])
    step(lambda: run.save_weights_for_sampler().result()["version"])
    step(lambda: run.sample(prompt, 1, num_samples=2, max_tokens=6, temperature=1.0, seed=4).result()["sequences"])
    step(lambda: run.compute_logprobs([prompt + [5, 6, 7]], version=1).result())
    step(lambda: sorted(run.save_state("s").result()["package"]))
    run.cancel()
    until(lambda: _runs(http) == {"in_memory": 0, "paged_out": 0, "page_idle_seconds": IDLE if paged else None,
                                  "max_resident_runs": None}, 30, "the cancelled run's state gone")
    assert not list((server.config.data_dir / "paged").glob("engine-*/run-*")), "its page file removed"
    return out


def test_a_paging_server_gives_the_numbers_of_one_that_never_pages(make_server, tmp_path):
    reference = make_server(data_dir=tmp_path / "reference")
    assert _runs(reference.http()) == {"in_memory": 0, "paged_out": 0, "page_idle_seconds": None,
                                       "max_resident_runs": None}
    paging = make_server(data_dir=tmp_path / "paging", engine=EngineConfig(page_idle_seconds=IDLE))
    assert paging.engine.pager.root == tmp_path / "paging" / "paged", "pages go to the data dir"
    expected = _train(reference, paged=False)
    assert _train(paging, paged=True) == expected
    m = scrape(paging.http())
    assert value(m, "whitney_page_ins_total") == value(m, "whitney_page_outs_total") >= 8
    assert value(m, "whitney_page_in_seconds_total") > 0 and value(m, "whitney_page_out_seconds_total") > 0
    # Each optim_step after a page-in read the run's moments back (the forward_backwards before them did not).
    assert value(m, "whitney_moment_reads_total") >= 1 and value(m, "whitney_moment_read_seconds_total") > 0
    for kind in ("page_out", "page_in", "moment_read"):  # histograms with the counters' counts and sums
        name = f"whitney_{kind}_duration_seconds"
        counted = value(m, f"whitney_{kind}s_total")
        assert value(m, f"{name}_count") == value(m, f"{name}_bucket", le="+Inf") == counted
        assert value(m, f"{name}_sum") == value(m, f"whitney_{kind}_seconds_total") > 0
        assert value(m, f"{name}_bucket", le="0.01") <= value(m, f"{name}_bucket", le="5.0") <= counted


def test_a_run_in_use_is_not_paged_out(make_server, tmp_path):
    server = make_server(engine=EngineConfig(page_idle_seconds=5.0))
    http = server.http()
    run = Client(server.url).create_session().create_run(**LORA, seed=3)
    assert _runs(http) == {"in_memory": 1, "paged_out": 0, "page_idle_seconds": 5.0, "max_resident_runs": None}
    for _ in range(7):  # 7 s of use, never 5 s apart
        run.forward_backward(sft_batch()).result()
        assert _runs(http)["paged_out"] == 0
        time.sleep(1.0)  # the point: a client's pause between uses, well under the idle time the test sets
    until(lambda: _runs(http)["paged_out"] == 1, 30, "paged out once idle")


def test_a_budget_server_holds_n_runs_in_memory_with_the_numbers_of_one_without(make_server, tmp_path):
    """Three clients' runs trained in turns on a server that keeps one run in memory: each turn pages the
    previous run out and this one in, and every number equals a server without a budget."""

    def train(server) -> list:
        http = server.http()
        runs = [Client(server.url).create_session().create_run(**LORA, seed=3 + i) for i in range(3)]
        out = []
        for _ in range(2):
            for run in runs:
                out.append(run.forward_backward(sft_batch()).result()["loss"])
                out.append(run.optim_step(learning_rate=1e-2).result()["metrics"])
                if server.engine.pager.max_resident is not None:  # the pushed-out run's write may be in flight
                    until(lambda: _runs(http)["paged_out"] == 2, 30, "the other two runs' files written")
                    assert _runs(http)["in_memory"] == 1
        return out

    budget = make_server(data_dir=tmp_path / "budget", engine=EngineConfig(max_resident_runs=1))
    assert _runs(budget.http())["max_resident_runs"] == 1
    assert train(budget) == train(make_server(data_dir=tmp_path / "reference"))
    assert value(scrape(budget.http()), "whitney_page_ins_total") >= 6


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_lost_page_file_interrupts_its_run_alone_with_a_clear_error(make_server, tmp_path, damage):
    """Issue 31, item 9: a paged-out run whose page file had a byte flipped, was truncated or was deleted is never
    trained on with what is left: its next operation and the one queued behind it fail with worker_lost, saying
    the run lost its state and naming no server path; the run is interrupted; another paged-out run trains on."""
    server = make_server(engine=EngineConfig(page_idle_seconds=IDLE))
    http = server.http()
    hit, other = (Client(server.url).create_session().create_run(**LORA, seed=3 + i) for i in range(2))
    for run in (hit, other):
        run.forward_backward(sft_batch()).result()
        run.optim_step(learning_rate=1e-2).result()
    until(lambda: _runs(http)["paged_out"] == 2, 30, "both runs paged out")
    paged = server.engine.pager.paged[hit.id]
    do, cause = DAMAGES[damage]
    do(paged.path, paged)
    # The optim_step first (seq_id 3 waits for 2), so it is queued behind the forward_backward that finds the loss.
    queued = expect(http.post(f"/v1/runs/{hit.id}/optim_step", json={"seq_id": 3,
                                                                     "adam_params": {"learning_rate": 1e-2}}), 202)
    first = expect(http.post(f"/v1/runs/{hit.id}/forward_backward", json={"seq_id": 2, "data": sft_batch()}), 202)
    client = Client(server.url)
    ends = [client.operation(op["id"]).wait(60) for op in (first, queued)]
    for ended in ends:
        assert ended["status"] == "failed", ended
        error = ended["error"]
        assert error["code"] == "worker_lost" and "lost its state" in error["message"], error
        assert str(server.config.data_dir) not in error["message"] and "/" not in error["message"], error
    assert cause in ends[0]["error"]["message"], ends[0]["error"]
    until(lambda: hit.refresh()["status"] == "interrupted", 30, "the run interrupted")
    assert "lost its state" in hit.info["error"] and "/" not in hit.info["error"], hit.info
    assert other.forward_backward(sft_batch()).result()["loss"] > 0
    assert other.optim_step(learning_rate=1e-2).result()["metrics"]["step"] == 2.0


def test_paging_flags():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    default = engine_config(parser.parse_args([]))
    assert default.page_idle_seconds is None and default.max_resident_runs is None
    assert engine_config(parser.parse_args(["--page-idle-seconds", "30"])).page_idle_seconds == 30.0
    assert engine_config(parser.parse_args(["--max-resident-runs", "50"])).max_resident_runs == 50
    for flag, bad in (("--page-idle-seconds", "-1"), ("--page-idle-seconds", "nan"), ("--page-idle-seconds", "inf"),
                      ("--page-idle-seconds", "soon"), ("--max-resident-runs", "0"), ("--max-resident-runs", "-2"),
                      ("--max-resident-runs", "1.5"), ("--max-resident-runs", "many")):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, bad])
