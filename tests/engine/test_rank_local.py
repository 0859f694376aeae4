"""Rank-local loading (families/rank_local.py): each rank of a sharded trainer reads only its shards of the layer
weights, so its peak host memory while loading is about half of an unsharded load's on two ranks, on the fast path
and the general path; what it reads equals loading whole and sharding, bit for bit, through Hugging Face's key
renames and its stacking of per-expert weights.

Peak RSS is the kernel's high-water mark (VmHWM), reset just before the load (/proc/self/clear_refs), in a fresh
process per side, through the load and a read of every weight it holds: an unsharded load maps the checkpoint's
file, whose pages count once they are read (by the first forward, or here). A model whose layer weights are most of
it (8 layers, hidden 512, a vocabulary of 1024) makes the ratio the layers' share (134 MB of them, where the
tokenizer takes about 28 MB while it loads); the process first loads another model of the family, so that imports
are not counted.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.models import make_tiny_general_model, make_tiny_model, make_tiny_vision_model
from whitney.engine import Engine
from whitney.engine.families.general import GeneralModel
from whitney.engine.families import rank_local
from whitney.engine.families.rank_local import held_weights, load_sharded, load_whole_then_shard
from whitney.engine.training.sharded import ShardedEngine, shard_unit, spawn_ranks

GEOMETRY = dict(vocab_size=1024, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _load_peak(warm: str, model: str, sharded: bool) -> dict:
    """Load `warm`, then `model` and read its weights; the growth of this process's peak RSS from the second load's
    start (KiB)."""
    engine = ShardedEngine() if sharded else Engine(device="cpu")
    engine.load_model(warm)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the current RSS
    before = _status_kib("VmRSS")
    base = engine.load_model(model)
    for weight in held_weights(base):
        weight.sum()  # resident
    out = {"growth_kib": _status_kib("VmHWM") - before}
    if sharded:  # this rank's shard of every layer weight, and what it holds
        layers = base.decoder_stack.layers if isinstance(base, GeneralModel) else base.layers
        out["local"] = sum(p.to_local().numel() for p in layers.parameters())
        out["whole"] = sum(p.numel() for p in layers.parameters())
        out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rank-local")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_each_rank_reads_about_half_of_the_layers(root, kind):
    if kind == "llama":  # the fast path
        warm, model = make_tiny_model(root / "warm-llama", kind), make_tiny_model(root / kind, kind, **GEOMETRY)
    else:  # the general path
        warm = make_tiny_general_model(root / f"warm-{kind}", kind)
        model = make_tiny_general_model(root / kind, kind, **GEOMETRY)
    (whole,) = spawn_ranks(1, _load_peak, str(warm), str(model), False, backend="gloo", timeout=300)
    ranks = spawn_ranks(2, _load_peak, str(warm), str(model), True, backend="gloo", timeout=300)
    layer_kib = ranks[0]["whole"] * 4 // 1024
    assert whole["growth_kib"] >= layer_kib, (whole, layer_kib)  # the unsharded load holds every layer weight
    for r in ranks:
        assert r["local"] == r["whole"] // 2
        ratio = r["growth_kib"] / whole["growth_kib"]
        assert ratio <= 0.72, f"rank {r['rank']} peaked at {r['growth_kib']} KiB, {ratio:.2f} of an unsharded load"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _both_ways(models: dict[str, str]) -> dict[str, tuple[int, list[str]]]:
    """Each model loaded rank-locally (the whole load refused) and whole-then-sharded on this rank: kind -> (the
    weights and buffers compared, the names of those that differ)."""
    mesh = ShardedEngine().mesh
    out = {}
    for kind, path in models.items():
        with mock.patch.object(rank_local, "load_whole_then_shard", side_effect=AssertionError("loaded whole")):
            ours = load_sharded(path, torch.float32, shard_unit(mesh), torch.device("cpu"), dist.get_rank(), 2)
        whole = load_whole_then_shard(path, torch.float32, shard_unit(mesh), torch.device("cpu"))
        pairs = [*zip(ours.hf.named_parameters(), whole.hf.parameters()),
                 *zip(ours.hf.named_buffers(), whole.hf.buffers())]
        out[kind] = (len(pairs), [n for (n, a), b in pairs if not torch.equal(_local(a), _local(b))])
    return out


def test_general_families_read_their_shards_exactly(root):
    """Renamed keys and a tied head (Gemma 3's checkpoint), per-expert weights stacked (qwen3_moe), linear attention
    (Qwen3.5), a vision tower (Qwen3-VL): every weight and buffer equals the whole load's."""
    models = {"gemma3": make_tiny_general_model(root / "gemma3", "gemma3"),
              "qwen3_moe": make_tiny_general_model(root / "qwen3_moe", "qwen3_moe"),
              "qwen3_5_text": make_tiny_general_model(root / "qwen3_5_text", "qwen3_5_text"),
              "qwen3_vl": make_tiny_vision_model(root / "qwen3_vl", "qwen3_vl")}
    for rank_result in spawn_ranks(2, _both_ways, {k: str(v) for k, v in models.items()}, backend="gloo",
                                   timeout=300):
        for kind, (compared, differ) in rank_result.items():
            assert compared > 20 and differ == [], (kind, differ)
