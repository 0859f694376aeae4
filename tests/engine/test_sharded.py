"""FSDP2: a base sharded over 2 gloo ranks on the CPU computes what the unsharded engine computes.

The two ranks are spawned once for this module (the `sharded` fixture): each runs `_on_rank`, which
trains two runs in one batch for five steps, saves a sharded checkpoint and loads it back, and returns its
numbers. The tests compare those with the unsharded Engine in this process, and load the sharded
checkpoint here, on one process and on a one-rank group.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.engine.test_data_parallel import adam_state, assert_close, assert_states_close, whole_gradient
from tests.models import VOCAB
from whitney.engine import Datum, Engine, ForwardRequest, ForwardResult, LoraConfig
from whitney.engine.families.lora import RowGroups
from whitney.engine.families.model import load_base_model
from whitney.engine.training.sharded import ShardedEngine, load_sharded_state, spawn_ranks
from whitney.errors import Conflict, InvalidInput
from whitney.protocol.sampling import SamplingParams

REL = 1e-5
STEPS = 5
HP = {"learning_rate": 1e-2, "eps": 1e-8, "weight_decay": 0.1, "gradient_clip_norm": 1.0}
ADAM_ATOL = 1e-2 * HP["learning_rate"]  # per step: the rows' shares are summed apart (test_data_parallel.py)
# Two runs with different geometry and losses share every batch.
LORA = {"ce": LoraConfig(rank=4, alpha=8.0, seed=1),
        "is": LoraConfig(rank=2, alpha=4.0, seed=2, target_modules=("q_proj", "v_proj", "down_proj", "lm_head"))}
SEQS = [[1, 504, 2710, 88, 12, 9001, 33, 7], [1, 3000, 17], [1, 45, 45, 1200, 31000, 5, 6, 77, 408, 2]]


def _requests(step: int) -> list[ForwardRequest]:
    """Step-dependent datums of different lengths: cross_entropy with weights for one run,
    importance_sampling for the other."""
    g = torch.Generator().manual_seed(100 + step)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    ce = [Datum(tokens(n), {"target_tokens": tokens(n), "weights": torch.rand(n, generator=g).tolist()})
          for n in (5, 9)]
    rl = [Datum(tokens(n), {"target_tokens": tokens(n), "old_logprobs": [-11.0] * n,
                            "advantages": torch.randn(n, generator=g).tolist()}) for n in (3, 7)]
    return [ForwardRequest("ce", ce), ForwardRequest("is", rl, "importance_sampling")]


def _logprobs(engine: Engine, run_id: str) -> list[list[float | None]]:
    return engine.compute_logprobs(SEQS, run_id=run_id, version=engine.save_weights_for_sampler(run_id))


def _train(engine: Engine, model: str) -> dict:
    """Both runs through STEPS batches (forward_backward of both, then an optim_step each)."""
    for run_id, config in LORA.items():
        engine.create_run(run_id, model, config)
    out: dict = {"losses": [], "token_logprobs": [], "grad_norms": []}
    for step in range(STEPS):
        results = engine.run_batch(_requests(step), backward=True)
        assert all(isinstance(r, ForwardResult) for r in results), results
        out["losses"].append([r.loss for r in results])
        out["token_logprobs"].append([x for r in results for o in r.outputs for x in o.logprobs])
        if step == 0:
            out["first_grads"] = {r: whole_gradient(engine, r) for r in LORA}
        out["grad_norms"].append([engine.optim_step(r, HP)["grad_norm"] for r in LORA])
    out["final"] = {r: adam_state(engine, r) for r in LORA}
    out["logprobs"] = {r: _logprobs(engine, r) for r in LORA}
    # Sampling decodes through the same layers (a KV cache, one token per step); version 1 is _logprobs's.
    result = engine.sample(SEQS[0], SamplingParams(max_tokens=6, seed=3, num_samples=2, stop=()), run_id="ce",
                           version=1)
    out["samples"] = [(s.tokens, s.logprobs) for s in result.sequences]
    return out


def _gathers(engine: ShardedEngine, model: str) -> dict:
    """FSDP2's all-gathers in one forward and its backward, and whether the layers were back to their
    shards in between (so the backward had to gather them again)."""
    run = engine.create_run("probe", model, LoraConfig(rank=2, train_unembed=False))
    calls, gather = [], dist.all_gather_single

    def counted(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather_single = counted
    try:
        h = run.base.forward_hidden(torch.tensor([[1, 2, 3]]), RowGroups([(0, 1, run.adapter)]))
        between = all(isinstance(p, DTensor) for p in run.base.layers.parameters())
        out = {"forward": len(calls), "sharded_between": between}
        torch.autograd.grad(h.sum(), run.adapter.parameters())
        out["backward"] = len(calls) - out["forward"]
    finally:
        dist.all_gather_single = gather
        engine.delete_run("probe")
    return out


def _on_rank(model: str, path: str, tied_model: str) -> dict:
    """What each of the two ranks runs."""
    engine = ShardedEngine()
    layers = list(engine.load_model(model).layers.parameters())
    out = {"rank": dist.get_rank(), "dtensors_at_rest": all(isinstance(p, DTensor) for p in layers),
           "local": sum(p.to_local().numel() for p in layers), "whole": sum(p.numel() for p in layers)}
    # No whole copy of a layer's matrices is left anywhere in this process (2-D: norms share the final norm's
    # shape; a tensor over the rank's own shards may share a whole matrix's shape).
    shapes = {tuple(p.shape) for p in layers if p.dim() == 2}
    own = {p.to_local().untyped_storage().data_ptr() for p in layers}
    out["whole_matrices_alive"] = [tuple(t.shape) for t in gc.get_objects() if type(t) in (torch.Tensor, nn.Parameter)
                                   and tuple(t.shape) in shapes and t.untyped_storage().nbytes() > 0
                                   and t.untyped_storage().data_ptr() not in own]
    out["gathers"] = _gathers(engine, model)
    out |= _train(engine, model)
    out["dtensors_after_training"] = all(isinstance(p, DTensor) for p in layers)
    out["local_after_training"] = sum(p.to_local().numel() for p in layers)
    out["manifest"] = engine.save_state("ce", path)
    engine.create_run("back", model, LORA["ce"])
    engine.load_state("back", path, with_optimizer=True)
    out["reloaded"] = adam_state(engine, "back")
    out["reloaded_logprobs"] = _logprobs(engine, "back")
    # One more step from the saved run and from its reloaded copy: equal only if the AdamW state came back.
    for run_id in ("ce", "back"):
        engine.run_batch([ForwardRequest(run_id, _requests(STEPS)[0].data)], backward=True)
        engine.optim_step(run_id, HP)
    out["continued"] = {r: adam_state(engine, r)["weights"] for r in ("ce", "back")}
    # Refusals reach every rank; an export is written once (rank 0), the same adapter being on every rank.
    out["refusals"] = []
    for call in (lambda: engine.save_state("ce", path), lambda: engine.export_lora("ce", f"{path}-peft")) * 2:
        try:
            call()
            out["refusals"].append(None)
        except Conflict as e:
            out["refusals"].append(e.code)
    out["tied"] = _train(ShardedEngine(), tied_model)  # embedding and unembedding share one tensor
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sharded") / "ce-state")


@pytest.fixture(scope="module")
def sharded(tiny_qwen3, tiny_llama, checkpoint_dir) -> list[dict]:
    """Each rank's numbers (rank order), from one spawn of 2 gloo ranks."""
    return spawn_ranks(2, _on_rank, tiny_qwen3, checkpoint_dir, tiny_llama, backend="gloo", timeout=300)


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> dict:
    """The same training on the unsharded engine in this process."""
    return _train(Engine(device="cpu"), tiny_qwen3)


def _equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}.{k}: max diff {(got[k] - want[k]).abs().max().item()}"


def _nested(lp: list[list[float | None]]) -> list[float]:
    return [x for row in lp for x in row[1:]]


def test_each_rank_holds_half_of_every_layer_at_rest(sharded, tiny_qwen3):
    base = load_base_model(tiny_qwen3)
    whole = sum(t.numel() for lw in base.layers for t in (lw.input_norm, lw.post_attn_norm, lw.q_norm, lw.k_norm,
                                                           *lw.linear.values(), *lw.bias.values()))
    for r in sharded:
        assert r["dtensors_at_rest"] and r["dtensors_after_training"], "layer weights must be sharded DTensors"
        assert r["whole_matrices_alive"] == [], "a whole layer weight outlived the sharding"
        assert r["whole"] == whole, "the sharded parameters must cover every layer weight"
        assert r["local"] == whole // 2, f"rank {r['rank']} holds {r['local']} of {whole} layer values, not half"
        assert r["local_after_training"] == r["local"], "FSDP2 must free the gathered weights after backward"
        layers = len(base.layers)
        assert r["gathers"] == {"forward": layers, "sharded_between": True, "backward": layers}, \
            "each layer must be gathered for its forward, freed, and gathered again for its backward"


def test_first_forward_backward_equals_unsharded(sharded, reference):
    for r in sharded:
        assert_close(r["losses"][0], reference["losses"][0], "loss")
        assert_close(r["token_logprobs"][0], reference["token_logprobs"][0], "logprobs")
        assert_close(r["first_grads"], reference["first_grads"], "grads")


def test_five_step_trajectory_equals_unsharded(sharded, reference):
    for r in sharded:
        assert_close(r["losses"], reference["losses"], "losses")
        assert_close(r["grad_norms"], reference["grad_norms"], "grad_norms")
        assert_states_close(r["final"], reference["final"], STEPS * ADAM_ATOL, "final")
        for run_id in LORA:
            assert_close(_nested(r["logprobs"][run_id]), _nested(reference["logprobs"][run_id]), f"logprobs.{run_id}")
    assert reference["final"]["ce"]["weights"]["lm_head.lora_B"].abs().max() > 0, "training must move B"


def test_sampling_and_tied_embeddings_equal_unsharded(sharded, reference, tiny_llama):
    tied = _train(Engine(device="cpu"), tiny_llama)
    for r in sharded:
        for got, want in ((r, reference), (r["tied"], tied)):
            assert [t for t, _ in got["samples"]] == [t for t, _ in want["samples"]]
            assert_close([lp for _, lp in got["samples"]], [lp for _, lp in want["samples"]], "sample logprobs")
        assert_close(r["tied"]["losses"], tied["losses"], "tied losses")
        assert_states_close(r["tied"]["final"], tied["final"], STEPS * ADAM_ATOL, "tied final")


def test_ranks_end_with_identical_state(sharded):
    first, second = sharded
    assert first["losses"] == second["losses"]
    for run_id in LORA:
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            _equal(second["final"][run_id][part], first["final"][run_id][part], f"{run_id}.{part}")


def test_sharded_checkpoint_loads_back_on_two_ranks(sharded):
    for r in sharded:
        files = set(r["manifest"]["sha256"])
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= files, files
        assert r["manifest"]["world_size"] == 2 and r["manifest"]["optimizer_step"] == STEPS
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            _equal(r["reloaded"][part], r["final"]["ce"][part], part)
        assert r["reloaded_logprobs"] == r["logprobs"]["ce"]
        _equal(r["continued"]["back"], r["continued"]["ce"], "one step after reloading")
        assert r["refusals"] == ["conflict", None, "conflict", "conflict"], "save twice, export twice"


def test_sharded_checkpoint_loads_in_one_process(sharded, tiny_qwen3, checkpoint_dir):
    engine = Engine(device="cpu")
    engine.create_run("ce", tiny_qwen3, LORA["ce"])
    engine.load_state("ce", str(checkpoint_dir), with_optimizer=True)  # the ordinary path reads it too
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        _equal(adam_state(engine, "ce")[part], sharded[0]["final"]["ce"][part], part)
    assert engine.get_run("ce").optimizer.step == STEPS
    assert_close(_nested(_logprobs(engine, "ce")), _nested(sharded[0]["logprobs"]["ce"]), "logprobs")


def test_sharded_checkpoint_loads_on_a_one_rank_group(sharded, tiny_qwen3, checkpoint_dir):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = ShardedEngine()
        engine.create_run("ce", tiny_qwen3, LORA["ce"])
        engine.load_state("ce", checkpoint_dir, with_optimizer=True)
        for part in ("weights", "exp_avg", "exp_avg_sq"):
            _equal(adam_state(engine, "ce")[part], sharded[0]["final"]["ce"][part], part)
        assert_close(_nested(_logprobs(engine, "ce")), _nested(sharded[0]["logprobs"]["ce"]), "logprobs")
    finally:
        dist.destroy_process_group()


def test_corrupt_or_mismatched_sharded_checkpoint_is_refused(sharded, tiny_qwen3, checkpoint_dir, tmp_path):
    engine = Engine(device="cpu")
    run = engine.create_run("ce", tiny_qwen3, LORA["ce"])
    before = adam_state(engine, "ce")["weights"]
    with pytest.raises(InvalidInput, match="is a sharded checkpoint"):  # scored straight from the files: load it
        engine.compute_logprobs([[1, 2, 3]], checkpoint_path=str(checkpoint_dir))
    engine.create_run("other", tiny_qwen3, LORA["is"])
    with pytest.raises(InvalidInput, match="rank/alpha"):
        load_sharded_state(engine, "other", checkpoint_dir)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint_dir, corrupt)
    data = bytearray((corrupt / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (corrupt / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(InvalidInput, match="__1_0.distcp is missing or fails its checksum"):
        load_sharded_state(engine, "ce", corrupt, with_optimizer=True)
    _equal(adam_state(engine, "ce")["weights"], before, "weights after a refused load")
    assert run.optimizer.step == 0


def _on_rank_general(model: str) -> dict:
    """A general-path model (Hugging Face modules) on one of two ranks: its layers sharded, then trained."""
    engine = ShardedEngine()
    stack = engine.load_model(model).decoder_stack
    layers = list(stack.layers.parameters())
    out = {"dtensors_at_rest": all(isinstance(p, DTensor) for p in layers),
           "local": sum(p.to_local().numel() for p in layers), "whole": sum(p.numel() for p in layers)}
    out |= _train(engine, model)
    out["dtensors_after_training"] = all(isinstance(p, DTensor) for p in stack.layers.parameters())
    return out


def test_a_general_path_model_shards_and_trains_as_unsharded(tmp_path):
    """The general path shards through the same Decoder interface: each rank holds half of every layer weight,
    and training, scoring and sampling equal the unsharded engine's."""
    from tests.models import make_tiny_general_model

    path = str(make_tiny_general_model(tmp_path / "mistral", "mistral"))
    reference = _train(Engine(device="cpu"), path)
    ranks = spawn_ranks(2, _on_rank_general, path, backend="gloo", timeout=300)
    for r in ranks:
        assert r["dtensors_at_rest"] and r["dtensors_after_training"], "layer weights must be sharded DTensors"
        assert r["local"] == r["whole"] // 2, f"a rank holds {r['local']} of {r['whole']} layer values, not half"
        assert_close(r["losses"], reference["losses"], "losses")
        assert_close(r["grad_norms"], reference["grad_norms"], "grad_norms")
        assert_states_close(r["final"], reference["final"], STEPS * ADAM_ATOL, "final")
        for run_id in LORA:
            assert_close(_nested(r["logprobs"][run_id]), _nested(reference["logprobs"][run_id]), f"logprobs.{run_id}")
        assert [t for t, _ in r["samples"]] == [t for t, _ in reference["samples"]]
        assert_close([lp for _, lp in r["samples"]], [lp for _, lp in reference["samples"]], "sample logprobs")
    assert ranks[0]["losses"] == ranks[1]["losses"]
