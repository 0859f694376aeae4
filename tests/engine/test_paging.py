"""Idle runs paged out to disk and back (engine/paging.py): bitwise equal to never having left, memory given
back to the system (measured as the process's RSS), files gone with their runs."""

from __future__ import annotations

import errno
import gc
import threading
import time
from pathlib import Path

import pytest
import torch

from whitney.backends.in_process import InProcessBackend
from whitney.engine import Datum, Engine, ForwardRequest, LoraConfig
from whitney.engine.memory import page_file, paging
from whitney.engine.memory.paging import PagedMoments, remove_leftovers
from whitney.errors import Conflict, InvalidInput, NotFound, Unavailable
from whitney.protocol.backend import Failure, WorkerLost
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SamplingParams
from whitney.protocol.training import AdamParams

LORA = LoraConfig(rank=4, alpha=8.0, seed=7)


def _data(step: int) -> list[Datum]:
    """Two datums of different lengths, different every step."""
    a = [(7 * step + 3 * i) % 900 + 5 for i in range(9)]
    b = [(11 * step + 5 * i) % 900 + 5 for i in range(6)]
    return [Datum(a[:-1], {"target_tokens": a[1:]}), Datum(b[:-1], {"target_tokens": b[1:], "weights": [1.0] * 5})]


def _state(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    """Every tensor the run holds, by a name saying where it is."""
    run = engine.get_run(run_id)
    out = {f"adapter/{k}": t for k, t in run.adapter.named_parameters()}
    out.update({f"exp_avg/{k}": t for k, t in run.optimizer.exp_avg.items()})
    out.update({f"exp_avg_sq/{k}": t for k, t in run.optimizer.exp_avg_sq.items()})
    out.update({f"grads/{k}": t for k, t in run.grads.items()})
    out.update({f"staged/{s}/{k}": t for s, g in run.staged.items() for k, t in g.items()})
    out.update({f"version/{v}/{k}": t for v, a in run.sampler_versions.items() for k, t in a.named_parameters()})
    return out


def _assert_same_state(a: Engine, b: Engine, run_id: str) -> None:
    sa, sb = _state(a, run_id), _state(b, run_id)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        ta, tb = sa[name], sb[name]
        assert ta.dtype == tb.dtype and ta.shape == tb.shape and ta.stride() == tb.stride(), name
        assert ta.requires_grad == tb.requires_grad, name
        assert torch.equal(ta.detach(), tb.detach()), f"{name} differs after paging"
    assert a.get_run(run_id).optimizer.step == b.get_run(run_id).optimizer.step


def _counts(engine: Engine) -> dict:
    return {k: engine.residency()[k] for k in ("in_memory", "paged_out")}


def _page_out_now(engine: Engine, run_id: str) -> None:
    """Run the sweep the scheduler runs, with the clock past the idle time, and check the run left memory."""
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 1
    run = engine.runs[run_id]
    assert run.adapter is None and run.optimizer is None and not run.grads and not run.sampler_versions
    assert not engine.pager.settle(), "its files are written"
    assert _counts(engine) == {"in_memory": 0, "paged_out": 1}


def test_a_run_paged_out_between_every_step_equals_one_never_paged(tiny_model, tmp_path):
    """Identical seeds and data; one engine pages its run out (and so back in) before every operation: every
    loss, log-prob, gradient (accumulated and staged), weight, AdamW moment, sampler version and sample is
    bitwise the same as the engine that never pages."""
    kept = Engine()
    paged = Engine(page_idle_seconds=0, paging_dir=str(tmp_path / "paged"))
    for engine in (kept, paged):
        engine.create_run("r", tiny_model, LORA)
    prompt = [1, 523, 1077, 33]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, num_samples=2, stop=())

    def loss(result):
        return result.loss, result.metrics, [(o.logprobs, o.elementwise_loss) for o in result.outputs]

    def operations(step: int):
        """(name, operation on an engine -> plain numbers), in a training loop's order."""
        micro = _data(step + 10)
        return [
            ("forward_backward", lambda e: loss(e.forward_backward("r", _data(step)))),
            # A micro-batched operation part-way: its staged gradient is paged with the run.
            ("micro-batch 1", lambda e: loss(e.run_batch([ForwardRequest("r", micro[:1], stage="op")], True)[0])),
            ("micro-batch 2", lambda e: loss(e.run_batch([ForwardRequest("r", micro[1:], stage="op")], True)[0])),
            ("commit", lambda e: e.commit_gradients("r", "op")),
            ("optim_step", lambda e: e.optim_step("r", {"learning_rate": 0.05, "gradient_clip_norm": 1.0,
                                                         "weight_decay": 0.01})),
            ("save_weights_for_sampler", lambda e: e.save_weights_for_sampler("r")),
            ("sample", lambda e: [(s.tokens, s.logprobs) for s in
                                  e.sample(prompt, params, run_id="r", version=step + 1).sequences]),
            ("compute_logprobs", lambda e: e.compute_logprobs([prompt + [5, 6, 7]], run_id="r", version=1)),
        ]

    for step in range(3):
        for name, op in operations(step):
            _page_out_now(paged, "r")
            assert op(kept) == op(paged), f"step {step}, {name}: the paged run's numbers differ"
            _assert_same_state(kept, paged, "r")
    totals = paged.residency()
    assert totals["page_outs"] == totals["page_ins"] == 24 and totals["page_in_seconds"] > 0
    for kind in ("page_out", "page_in"):  # each one's time in its histogram's buckets
        histogram = totals[f"{kind}_histogram"]
        assert list(histogram)[-1] == "+Inf" and sum(histogram.values()) == 24, histogram
    # Training moved the weights (the test compares something) and every version is kept.
    assert sorted(paged.get_run("r").sampler_versions) == [1, 2, 3]
    assert any(float(b.detach().abs().max()) > 0 for b in paged.get_run("r").adapter.B.values())


def test_moments_stay_in_their_file_until_the_optimizer_is_used(tiny_llama, tmp_path):
    """A page-in reads the adapter (and the rest) only: a forward_backward after it reads no moment, a page-out
    before the next optim_step writes none (their file stays as it was), and the optim_step reads them, with
    every number bitwise an engine's that never paged. A run deleted or loaded over with its moments still
    out leaves no file behind."""
    kept = Engine()
    paged = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    params = {"learning_rate": 0.05, "weight_decay": 0.01}
    for engine in (kept, paged):
        engine.create_run("r", tiny_llama, LORA)
        engine.forward_backward("r", _data(0))
        engine.optim_step("r", params)
    _page_out_now(paged, "r")
    (own,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    (moments_file,) = own.glob("*.moments.bin")
    moments_bytes = moments_file.read_bytes()
    for step in (1, 2):
        losses = [e.forward_backward("r", _data(step)).loss for e in (kept, paged)]
        assert losses[0] == losses[1]
        assert paged.residency()["moment_reads"] == 0 and isinstance(paged.runs["r"].optimizer_state, PagedMoments)
        _page_out_now(paged, "r")
        assert list(own.glob("*.moments.bin")) == [moments_file] and moments_file.read_bytes() == moments_bytes
    metrics = [e.optim_step("r", params) for e in (kept, paged)]
    assert metrics[0] == metrics[1]
    totals = paged.residency()
    assert totals["moment_reads"] == 1 and totals["moment_read_seconds"] > 0
    assert not moments_file.exists(), "read back, then deleted"
    _assert_same_state(kept, paged, "r")
    # Deleted, or loaded over, while its moments are still in their file: the file goes.
    paged.save_state("r", str(tmp_path / "state"))
    for use in (lambda: paged.delete_run("r"),
                lambda: paged.load_state("r", str(tmp_path / "state"), with_optimizer=True)):
        if "r" not in paged.runs:
            paged.create_run("r", tiny_llama, LORA)
            paged.load_state("r", str(tmp_path / "state"), with_optimizer=True)
        _page_out_now(paged, "r")
        paged.get_run("r")
        assert len(list(own.glob("*.moments.bin"))) == 1
        use()
        assert not list(own.glob("*.moments.bin"))
    paged.get_run("r")
    _assert_same_state(kept, paged, "r")


def test_a_general_path_moe_run_pages_bitwise(tmp_path):
    """The general path (Hugging Face modules, LoRA per expert: A [E, r, in], B [E, out, r]) pages the same."""
    from tests.models import make_tiny_general_model

    model = str(make_tiny_general_model(tmp_path / "moe", "qwen3_moe"))
    kept = Engine()
    paged = Engine(page_idle_seconds=0, paging_dir=str(tmp_path / "paged"))
    lora = LoraConfig(rank=4, alpha=8.0, seed=3, target_modules=("q_proj", "experts.gate_up_proj", "experts.down_proj"))
    for engine in (kept, paged):
        engine.create_run("r", model, lora)
    assert any(t.dim() == 3 for t in paged.get_run("r").adapter.parameters()), "an expert projection is adapted"
    for step in range(2):
        for name, op in (("forward_backward", lambda e: e.forward_backward("r", _data(step)).loss),
                         ("optim_step", lambda e: e.optim_step("r", {"learning_rate": 0.05}))):
            _page_out_now(paged, "r")
            assert op(kept) == op(paged), f"step {step}, {name}"
            _assert_same_state(kept, paged, "r")


def test_a_gradient_in_a_transposed_layout_comes_back_in_it(tiny_llama, tmp_path):
    """Autograd may hand back a gradient as a transposed view; its layout (strides) decides the order of a
    norm's sums, so it is kept, not made contiguous."""
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    run = engine.create_run("r", tiny_llama, LORA)
    name, weight = run.adapter.named_parameters()[0]
    grad = torch.randn(tuple(reversed(weight.shape))).T  # [r, in] over an [in, r] storage
    run.grads[name] = grad
    _page_out_now(engine, "r")
    back = engine.get_run("r").grads[name]
    assert back.stride() == grad.stride() and not back.is_contiguous() and torch.equal(back, grad)


def test_each_tensor_comes_back_with_its_dtype_shape_strides_flag_and_bytes_in_memory_of_its_own(tiny_llama, tmp_path):
    """Tensors of every layout paging must keep: half types, a transpose, a permuted 3-D tensor, an empty one,
    integers, odd byte counts (the next one is padded to 64 bytes) and a 4 MB one (its block is read into a
    mapping of its own). Each comes back bitwise, a leaf with its own storage (not a view of its block: a
    safetensors save would refuse shared storage, and a transpose's storage would not cover it), 64-byte
    aligned, still writable in place without touching its neighbours."""
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    run = engine.create_run("r", tiny_llama, LORA)
    g = torch.Generator().manual_seed(0)
    sent = {
        "odd": torch.randn(3, generator=g),  # 12 bytes
        "big": torch.randn(1100, 1000, generator=g),  # 4.4 MB: the block goes over 2 MB
        "bf16_t": torch.randn(64, 48, generator=g).to(torch.bfloat16).T,
        "half_3d": torch.randn(3, 5, 7, generator=g).half().permute(2, 0, 1),
        "empty": torch.zeros(0, 5),
        "long": torch.arange(-3, 4, dtype=torch.int64),
        "flagged": torch.randn(5, 6, generator=g).requires_grad_(True),
    }
    run.grads.update(sent)
    run.staged["s"] = {"one": torch.randn(2, 9, generator=g).double()}
    run.staged["z"] = {"nothing": torch.zeros(3, 0)}  # the last bytes written are none
    before = {k: t.detach().clone().contiguous() for k, t in sent.items()}
    staged_before = run.staged["s"]["one"].clone()
    _page_out_now(engine, "r")
    run = engine.get_run("r")
    back = run.grads
    assert sorted(back) == sorted(sent) and torch.equal(run.staged["s"]["one"], staged_before)
    assert run.staged["z"]["nothing"].shape == (3, 0)
    for name, t in sent.items():
        b = back[name]
        assert (b.dtype, b.shape, b.stride(), b.requires_grad) == (t.dtype, t.shape, t.stride(), t.requires_grad), name
        assert b.is_leaf and b._base is None, f"{name} is a view"
        assert b.untyped_storage().nbytes() == b.numel() * b.element_size(), f"{name} shares its storage"
        assert torch.equal(b.detach().contiguous().view(torch.uint8), before[name].view(torch.uint8)), name
        if b.numel():
            assert b.data_ptr() % 64 == 0, f"{name} is not 64-byte aligned"
    with torch.no_grad():
        back["odd"].add_(1.0)
    assert torch.equal(back["big"], before["big"]) and torch.equal(back["odd"], before["odd"] + 1.0)
    # Pages back out and in again from the tensors built over the read-back memory.
    _page_out_now(engine, "r")
    again = engine.get_run("r").grads
    assert torch.equal(again["big"], before["big"]) and again["bf16_t"].stride() == sent["bf16_t"].stride()


def test_saves_exports_and_loads_page_the_run_in(tiny_llama, tmp_path):
    kept = Engine()
    paged = Engine(page_idle_seconds=0, paging_dir=str(tmp_path / "paged"))
    for engine in (kept, paged):
        engine.create_run("r", tiny_llama, LORA)
        engine.forward_backward("r", _data(0))
        engine.optim_step("r", {"learning_rate": 0.05})
    _page_out_now(paged, "r")
    for engine, out in ((kept, tmp_path / "kept"), (paged, tmp_path / "paged-out")):
        engine.save_state("r", str(out / "state"))
        engine.export_lora("r", str(out / "peft"))
    for name in ("adapter.safetensors", "optimizer.safetensors", "whitney_state.json"):  # sha256s in the last
        kept_file, paged_file = tmp_path / "kept" / "state" / name, tmp_path / "paged-out" / "state" / name
        assert kept_file.read_bytes() == paged_file.read_bytes(), name
    assert ((tmp_path / "kept" / "peft" / "adapter_model.safetensors").read_bytes()
            == (tmp_path / "paged-out" / "peft" / "adapter_model.safetensors").read_bytes())
    _page_out_now(paged, "r")
    paged.load_state("r", str(tmp_path / "kept" / "state"), with_optimizer=True)
    kept.load_state("r", str(tmp_path / "kept" / "state"), with_optimizer=True)
    _assert_same_state(kept, paged, "r")


def test_only_idle_runs_are_paged_and_validate_never_pages_in(tiny_llama, tmp_path):
    engine = Engine(page_idle_seconds=1.0, paging_dir=str(tmp_path))
    engine.create_run("idle", tiny_llama, LORA)
    engine.create_run("busy", tiny_llama, LORA)
    assert engine.page_out_idle() == 0, "nothing is idle yet"
    for run_id in ("idle", "busy"):  # both last used 1.05 s ago (the pager's clock, not a wait)
        engine.pager.last_used[run_id] -= 1.05
    engine.get_run("busy")  # a use
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 1 and not engine.pager.settle()
    assert set(engine.pager.paged) == {"idle"} and _counts(engine) == {"in_memory": 1, "paged_out": 1}
    # Validation (the HTTP thread's) reads the base only: the run stays out.
    assert engine.validate(ForwardRequest("idle", _data(0)), backward=True).positions_D == [8, 5]
    assert "idle" in engine.pager.paged
    engine.forward_backward("idle", _data(0))
    assert _counts(engine) == {"in_memory": 2, "paged_out": 0}


def _sampled_run(engine: Engine, run_id: str, model: str):
    """A new run with a sampling request in flight on its first version; the request."""
    engine.create_run(run_id, model, LORA)
    version = engine.save_weights_for_sampler(run_id)
    return engine.submit_sample([1, 2, 3], SamplingParams(max_tokens=4, seed=1, stop=()), run_id=run_id,
                                version=version)


def test_a_run_sampled_from_stays_in_memory_until_its_request_ends(tiny_llama, tmp_path):
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    request = _sampled_run(engine, "r", tiny_llama)
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 0 and _counts(engine)["paged_out"] == 0, "its version is being sampled"
    while not request.done:
        engine.sample_step()
    assert len(request.result.sequences[0].tokens) == 4
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 1


def test_delete_create_and_unknown_runs_while_paged(tiny_llama, tmp_path):
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    engine.create_run("r", tiny_llama, LORA)
    engine.pager._next_sweep = 0.0
    engine.page_out_idle()
    engine.pager.settle()
    (own,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert len(list(own.glob("run-*"))) == 1
    with pytest.raises(Conflict):
        engine.create_run("r", tiny_llama, LORA)
    with pytest.raises(NotFound) as e:
        engine.get_run("nope")
    assert e.value.field == "run_id"
    engine.discard_gradients("r", "no-such-stage")  # pages it in, drops nothing
    engine.pager._next_sweep = 0.0
    engine.page_out_idle()
    engine.delete_run("r")
    assert not list(own.glob("run-*")) and _counts(engine) == {"in_memory": 0, "paged_out": 0}
    backend = InProcessBackend(engine)
    backend.close()
    assert not own.exists(), "the engine's directory goes with it"


def test_a_run_that_cannot_be_written_stays_in_memory(tiny_llama, tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    engine = Engine(page_idle_seconds=0, paging_dir=str(blocked))
    engine.create_run("r", tiny_llama, LORA)
    assert engine.page_out_idle() == 0 and _counts(engine) == {"in_memory": 1, "paged_out": 0}
    assert engine.pager._next_sweep > time.monotonic() + 30, "not retried at every turn of the loop"
    engine.forward_backward("r", _data(0))


def test_a_page_out_is_written_off_the_engine_thread_and_a_page_in_waits_for_it(tiny_llama, tmp_path, monkeypatch):
    """The sweep returns while the run's files are still being written (the writer thread holds its state);
    the run's next use waits for the write and reads it back, bitwise."""
    kept, engine = Engine(), Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    for e in (kept, engine):
        e.create_run("r", tiny_llama, LORA)
        e.forward_backward("r", _data(0))
        e.optim_step("r", {"learning_rate": 0.05})
        e.forward_backward("r", _data(1))  # a gradient waiting for its optim_step goes out too
    go, write_file = threading.Event(), paging.write_file
    monkeypatch.setattr(paging, "write_file", lambda *a: go.wait(30) and write_file(*a))
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 1 and engine.runs["r"].adapter is None
    assert not engine.pager.leaving["r"].done(), "the engine thread did not wait for the write"
    assert _counts(engine) == {"in_memory": 1, "paged_out": 0}, "in memory until written"
    threading.Timer(0.2, go.set).start()
    _assert_same_state(kept, engine, "r")  # get_run waits for the write, then reads the files
    assert engine.residency()["page_ins"] == 1 and not engine.pager.leaving


def test_a_write_that_fails_puts_the_state_back(tiny_llama, tmp_path, monkeypatch):
    """A page-out whose write fails (a full disk) leaves no file and its run in memory with its own
    tensors, found by the next sweep (which then waits a minute) or the run's next use."""
    kept, engine = Engine(), Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    for e in (kept, engine):
        for run_id in ("a", "b"):
            e.create_run(run_id, tiny_llama, LORA)
            e.forward_backward(run_id, _data(0))
            e.optim_step(run_id, {"learning_rate": 0.05})

    def full(path, groups):
        Path(path).write_bytes(b"partial")
        Path(path).unlink()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(paging, "write_file", full)
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 2
    engine.forward_backward("a", _data(1))  # its next use: the failed write is found, nothing to read
    kept.forward_backward("a", _data(1))
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 0, "the sweep found b's failed write: none now"
    assert engine.pager._next_sweep > time.monotonic() + 30
    assert _counts(engine) == {"in_memory": 2, "paged_out": 0} and engine.residency()["page_outs"] == 0
    assert not [f for f in tmp_path.rglob("*") if f.is_file()]
    for run_id in ("a", "b"):
        _assert_same_state(kept, engine, run_id)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)


# Each way a page file is lost: what is done to it, and what the error says happened.
DAMAGES = {"flipped": (lambda path, paged: _flip_byte(path, paged.entries[-1].offset), "checksum does not match"),
           "truncated": (lambda path, paged: _truncate(path), "truncated"),
           "deleted": (lambda path, paged: path.unlink(), "missing")}


def _trained(engines: tuple[Engine, ...], run_ids: list[str], model: str) -> None:
    for e in engines:
        for run_id in run_ids:
            e.create_run(run_id, model, LORA)
            e.forward_backward(run_id, _data(0))
            e.optim_step(run_id, {"learning_rate": 0.05})
            e.forward_backward(run_id, _data(1))  # a gradient waiting for its optim_step goes out too


def _assert_lost(engine: Engine, run_id: str, cause: str, tmp_path: Path, error: BaseException) -> None:
    """The error is the run's loss (a WorkerLost), says what happened, names no path; the run and its files are
    gone from the engine, and each later use fails the same way."""
    message = str(error)
    assert isinstance(error, paging.RunStateLost) and isinstance(error, WorkerLost), repr(error)
    assert f"run {run_id!r} lost its state" in message and cause in message, message
    assert str(tmp_path) not in message and ".bin" not in message and "/" not in message, message
    assert run_id not in engine.runs and run_id not in engine.pager.paged and run_id not in engine.pager.last_used
    for use in (lambda: engine.forward(run_id, _data(2)), lambda: engine.optim_step(run_id, {}),
                lambda: engine.save_weights_for_sampler(run_id)):
        with pytest.raises(paging.RunStateLost) as again:
            use()
        assert str(again.value) == message
    with pytest.raises(Conflict) as refused:  # a request checked on another thread: a 4xx, not a 500
        engine.validate(ForwardRequest(run_id, _data(2)), backward=True)
    assert refused.value.message == message and refused.value.field == "run_id"
    with pytest.raises(Conflict):
        engine.create_run(run_id, engine.models[next(iter(engine.models))].name, LORA)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_page_file_damaged_truncated_or_deleted_loses_its_run_alone(tiny_llama, tmp_path, damage):
    """A paged-out run whose page file had a byte flipped, was truncated or was deleted is never used with
    what is left: its next use fails with RunStateLost (worker_lost through the backend, naming the run, not
    the file), the run is forgotten (files removed) and reported once by take_lost_runs; the other paged-out
    run's numbers are bitwise an engine's that never paged. Deleting the lost run frees its id."""
    kept, engine = Engine(), Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    _trained((kept, engine), ["hit", "other"], tiny_llama)
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 2 and not engine.pager.settle()
    paged = engine.pager.paged["hit"]
    do, cause = DAMAGES[damage]
    do(paged.path, paged)
    backend = InProcessBackend(engine)
    requests = [ForwardRequest("hit", _data(2)), ForwardRequest("other", _data(2))]
    failure, result = backend.run_batch(requests, backward=True)
    assert isinstance(failure, Failure) and failure.code == "worker_lost" and failure.category == "server", failure
    assert result == kept.run_batch([ForwardRequest("other", _data(2))], backward=True)[0]
    with pytest.raises(paging.RunStateLost) as lost:
        engine.get_run("hit")
    assert failure.message == str(lost.value)
    _assert_lost(engine, "hit", cause, tmp_path, lost.value)
    assert not paged.path.exists() and not paged.optimizer.path.exists(), "its files removed"
    assert backend.take_lost_runs() == ["hit"] and backend.take_lost_runs() == [], "reported once"
    assert engine.optim_step("other", {"learning_rate": 0.05}) == kept.optim_step("other", {"learning_rate": 0.05})
    _assert_same_state(kept, engine, "other")
    engine.delete_run("hit")
    with pytest.raises(NotFound):
        engine.get_run("hit")
    engine.create_run("hit", tiny_llama, LORA)  # the id is free again
    engine.forward_backward("hit", _data(0))


def test_a_damaged_moments_file_loses_the_run_at_its_optim_step_alone(tiny_llama, tmp_path):
    """The AdamW moments, read only at the run's next optim_step, are checked too: a byte flipped in their file
    fails that step (the batched optim_steps' other runs step as the never-paged engine's) and loses the run."""
    kept, engine = Engine(), Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    _trained((kept, engine), ["hit", "other"], tiny_llama)
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 2 and not engine.pager.settle()
    moments = engine.pager.paged["hit"].optimizer
    _flip_byte(moments.path, moments.entries[0].offset)
    assert engine.forward("hit", _data(2)).loss == kept.forward("hit", _data(2)).loss, "moments not read yet"
    params = AdamParams(learning_rate=0.05)
    failure, metrics = InProcessBackend(engine).optim_steps([("hit", params), ("other", params)])
    assert isinstance(failure, Failure) and failure.code == "worker_lost", failure
    assert metrics == kept.optim_step("other", params)
    with pytest.raises(paging.RunStateLost) as lost:
        engine.get_run("hit")
    _assert_lost(engine, "hit", "checksum does not match", tmp_path, lost.value)
    assert failure.message == str(lost.value) and not moments.path.exists()
    assert engine.take_lost_runs() == ["hit"]
    _assert_same_state(kept, engine, "other")


def test_a_page_file_read_short_of_file_descriptors_is_retried_not_lost(tiny_llama, tmp_path, monkeypatch):
    """A read refused for want of a resource that comes back (EMFILE) is Unavailable, naming no path; the run
    stays paged out and its next use reads it back, bitwise."""
    kept, engine = Engine(), Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    _trained((kept, engine), ["r"], tiny_llama)
    _page_out_now(engine, "r")
    path = engine.pager.paged["r"].path

    def no_descriptors(*args):
        raise OSError(errno.EMFILE, "Too many open files", str(path))
        yield  # a generator, as read_file is

    read_file = paging.read_file
    monkeypatch.setattr(paging, "read_file", no_descriptors)
    with pytest.raises(Unavailable) as e:
        engine.forward("r", _data(2))
    assert str(tmp_path) not in e.value.message and "Too many open files" in e.value.message
    assert "r" in engine.pager.paged and engine.take_lost_runs() == []
    monkeypatch.setattr(paging, "read_file", read_file)
    _assert_same_state(kept, engine, "r")


def test_page_idle_seconds_must_be_a_finite_non_negative_number(tmp_path):
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(InvalidInput) as e:
            Engine(page_idle_seconds=bad, paging_dir=str(tmp_path))
        assert e.value.field == "page_idle_seconds" and ">= 0" in e.value.message
    config = InProcessBackend.start(EngineConfig(page_idle_seconds=2.5, paging_dir=str(tmp_path)), []).config
    assert config.page_idle_seconds == 2.5 and config.paging_dir == str(tmp_path)


def test_directories_of_ended_processes_are_removed(tmp_path):
    import socket
    import subprocess

    finished = subprocess.Popen(["true"])
    finished.wait()
    ended = finished.pid  # a process that has ended (its pid not yet reused, within this test)
    host = socket.gethostname()
    gone = tmp_path / f"engine-{host}-{ended}-abc"
    live = tmp_path / f"engine-{host}-1-abc"  # pid 1 always runs
    other_host = tmp_path / f"engine-not-{host}-{ended}-abc"
    for d in (gone, live, other_host):
        d.mkdir()
    remove_leftovers(tmp_path)
    assert not gone.exists() and live.exists() and other_host.exists()


def _rss() -> int:
    """This process's resident memory in bytes (/proc/self/statm: pages)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS read from /proc (Linux)")
def test_paged_out_and_deleted_runs_give_their_memory_back(tiny_llama, tmp_path):
    """Measured as RSS, not Python objects: 8 runs at rank 32 with AdamW state (about 19 MB each on the
    tiny model, whose unembedding B is [49152, 32]) paged out, back in, and deleted."""
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    lora = LoraConfig(rank=32, seed=1)
    for i in range(8):
        engine.create_run(f"r{i}", tiny_llama, lora)
        engine.forward_backward(f"r{i}", _data(i))
        engine.optim_step(f"r{i}", {"learning_rate": 0.01})
    sizes = {}  # what the runs hold: their moments, and the rest
    for i in range(8):
        for name, t in _state(engine, f"r{i}").items():
            kind = "moments" if name.startswith("exp_avg") else "rest"
            sizes[kind] = sizes.get(kind, 0) + t.numel() * t.element_size()
    held = sizes["moments"] + sizes["rest"]
    assert held > 8 * 15 * 2**20 and sizes["moments"] > sizes["rest"]
    before = _rss()
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 8
    engine.pager.settle()  # the writes are done (the writer thread frees each run's memory once written)
    out = _rss()
    assert before - out > 0.8 * held, f"paging out {held / 2**20:.0f} MB freed only {(before - out) / 2**20:.0f} MB"
    for i in range(8):
        engine.get_run(f"r{i}")
    adapters = _rss()
    assert 0.8 * sizes["rest"] < adapters - out < sizes["rest"] + 0.2 * sizes["moments"], "moments stay out"
    for i in range(8):
        assert engine.get_run(f"r{i}").optimizer.exp_avg  # the first use of the optimizer reads them
    back = _rss()
    assert back - out > 0.8 * held
    for i in range(8):
        engine.delete_run(f"r{i}")
    assert back - _rss() > 0.8 * held, "deleted runs' memory returned"


def test_paged_runs_of_one_config_in_one_state_keep_one_list_of_entries(tiny_llama, tmp_path):
    """What a paged-out run keeps in memory does not grow with its tensor count: runs of one adapter config in
    the same state write the same entries, and keep one list of them (page_file.Layout; SmolLM2: 1,266 per
    run, ~0.36 MB of RSS), gone with the last run keeping it."""
    gc.collect()
    layouts = len(page_file._LAYOUTS)
    engine = Engine(page_idle_seconds=0, paging_dir=str(tmp_path))
    for i, rank in enumerate([4, 4, 4, 8]):
        engine.create_run(f"r{i}", tiny_llama, LoraConfig(rank=rank, seed=i))
        engine.forward_backward(f"r{i}", _data(i))
        engine.optim_step(f"r{i}", {"learning_rate": 0.01})
    engine.forward_backward("r2", _data(9))  # a gradient waiting for its optim_step: one more group in its file
    engine.pager._next_sweep = 0.0
    assert engine.page_out_idle() == 4 and not engine.pager.settle()
    paged = engine.pager.paged
    assert paged["r0"].entries is paged["r1"].entries
    assert paged["r0"].optimizer.entries is paged["r1"].optimizer.entries is paged["r2"].optimizer.entries
    assert paged["r2"].entries != paged["r0"].entries and paged["r3"].entries != paged["r0"].entries
    assert len(page_file._LAYOUTS) == layouts + 5  # adapter files: rank 4, rank 4 with a gradient, rank 8; moments: 2
    kept = Engine()  # the same runs, never paged: the shared entries read each run's own bytes back
    for i, rank in enumerate([4, 4, 4, 8]):
        kept.create_run(f"r{i}", tiny_llama, LoraConfig(rank=rank, seed=i))
        kept.forward_backward(f"r{i}", _data(i))
        kept.optim_step(f"r{i}", {"learning_rate": 0.01})
    kept.forward_backward("r2", _data(9))
    for i in range(4):
        _assert_same_state(kept, engine, f"r{i}")
    for i in range(4):
        engine.delete_run(f"r{i}")
    gc.collect()
    assert len(page_file._LAYOUTS) == layouts


def _resident(engine: Engine) -> set[str]:
    return {r for r in engine.runs if r not in engine.pager.paged}


def test_a_residency_budget_keeps_n_runs_in_memory_with_the_same_numbers(tiny_llama, tmp_path):
    """Five runs trained together, one engine call for all of them each step, under a budget of 2: never
    more than 2 runs in memory (checked at every page-in and creation), the least recently used pushed out,
    and every loss, metric and tensor bitwise those of an engine without a budget."""
    kept = Engine()
    budget = Engine(max_resident_runs=2, paging_dir=str(tmp_path))
    most = []
    page_in = budget.pager.page_in

    def checked_page_in(run):
        page_in(run)
        most.append(len(_resident(budget)))

    budget.pager.page_in = checked_page_in
    ids = [f"r{i}" for i in range(5)]
    for engine in (kept, budget):
        for i, run_id in enumerate(ids):
            engine.create_run(run_id, tiny_llama, LoraConfig(rank=4, alpha=8.0, seed=i))
            assert engine is kept or len(_resident(engine)) <= 2
    budget.pager.settle()  # the last creation's push-out is written
    assert _counts(budget) == {"in_memory": 2, "paged_out": 3}
    params = AdamParams(learning_rate=0.05, weight_decay=0.01)
    for step in range(2):
        requests = [ForwardRequest(run_id, _data(3 * step + i)) for i, run_id in enumerate(ids)]
        results = [e.run_batch(requests, backward=True) for e in (kept, budget)]
        assert [(r.loss, r.metrics) for r in results[0]] == [(r.loss, r.metrics) for r in results[1]]
        assert _resident(budget) == {"r3", "r4"}, "parts of 2, 2 and 1 runs: r2 pushed out for r4"
        metrics = [e.optim_steps([(run_id, params) for run_id in ids]) for e in (kept, budget)]
        assert metrics[0] == metrics[1] and all(isinstance(m, dict) for m in metrics[1])
    assert most and max(most) <= 2, most
    for run_id in ids:
        _assert_same_state(kept, budget, run_id)
    assert any(float(b.detach().abs().max()) > 0 for b in budget.get_run("r0").adapter.B.values())


def test_the_budget_spares_runs_being_sampled_and_refuses_nothing(tiny_llama, tmp_path):
    engine = Engine(max_resident_runs=1, paging_dir=str(tmp_path))
    request = _sampled_run(engine, "sampled", tiny_llama)
    engine.create_run("other", tiny_llama, LORA)
    assert _resident(engine) == {"sampled", "other"}, "over budget while its version is sampled"
    while not request.done:
        engine.sample_step()
    engine.create_run("third", tiny_llama, LORA)
    assert _resident(engine) == {"third"}, "both pushed out once the request ended"
    engine.forward_backward("sampled", _data(0))
    assert _resident(engine) == {"sampled"}


def test_max_resident_runs_must_be_a_positive_integer(tmp_path):
    for bad in (0, -1, 2.0, "3", True):
        with pytest.raises(InvalidInput) as e:
            Engine(max_resident_runs=bad, paging_dir=str(tmp_path))
        assert e.value.field == "max_resident_runs" and ">= 1" in e.value.message
    config = InProcessBackend.start(EngineConfig(max_resident_runs=3, paging_dir=str(tmp_path)), []).config
    assert config.max_resident_runs == 3 and config.page_idle_seconds is None
