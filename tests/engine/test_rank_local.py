"""Rank-local loading (families/rank_local.py): each rank of a sharded trainer reads only its shards of the layer
weights, so its peak host memory while loading is about half of an unsharded load's on two ranks (the general
path, loaded whole and then sharded, is tested with the data-parallel tests).

Peak RSS is the kernel's high-water mark (VmHWM), reset just before the load (/proc/self/clear_refs), in a fresh
process per side, through the load and a read of every weight it holds: an unsharded load maps the checkpoint's
file, whose pages count once they are read (by the first forward, or here). A model whose layer weights are most of it (8 layers, hidden 512, a vocabulary of 1024) makes the
ratio the layers' share (134 MB of them, where the tokenizer takes about 28 MB while it loads); the process first
loads another model of the family, so that imports are not counted.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.models import make_tiny_model
from whitney.engine import Engine
from whitney.engine.families.rank_local import held_weights
from whitney.engine.training.sharded import ShardedEngine, spawn_ranks

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
        layers = [p for p in base.layers.parameters()]
        out["local"] = sum(p.to_local().numel() for p in layers)
        out["whole"] = sum(p.numel() for p in layers)
        out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("rank-local")
    return (str(make_tiny_model(root / "warm", "llama")),
            str(make_tiny_model(root / "layered", "llama", **GEOMETRY)))


def test_each_rank_reads_about_half_of_the_layers(models):
    warm, model = models
    (whole,) = spawn_ranks(1, _load_peak, warm, model, False, backend="gloo", timeout=300)
    ranks = spawn_ranks(2, _load_peak, warm, model, True, backend="gloo", timeout=300)
    layer_kib = ranks[0]["whole"] * 4 // 1024
    assert whole["growth_kib"] >= layer_kib, (whole, layer_kib)  # the unsharded load holds every layer weight
    for r in ranks:
        assert r["local"] == r["whole"] // 2
        ratio = r["growth_kib"] / whole["growth_kib"]
        assert ratio <= 0.72, f"rank {r['rank']} peaked at {r['growth_kib']} KiB, {ratio:.2f} of an unsharded load"
