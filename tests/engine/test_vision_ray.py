"""Images through the Ray backend (backends/ray): a request with image chunks is validated by the worker
(whose processor expands them), and forward, compute_logprobs and sampling with images equal the in-process
backend. Workers are real Ray actors on a local Ray instance; skipped when Ray is not installed."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_vision import _chunked, _image, _tokens
from tests.models import make_tiny_vision_model
from whitney.backends.in_process import InProcessBackend
from whitney.engine import Datum, ForwardRequest, Weights
from whitney.protocol.backend import Failure
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SamplingParams
from whitney.protocol.training import Checked

ray = pytest.importorskip("ray")
CONFIG = EngineConfig(device="cpu", compute_dtype="float32")


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    from whitney.backends.ray.proxy import Placement, RayBackend

    path = str(make_tiny_vision_model(tmp_path_factory.mktemp("vision-ray") / "gemma3", "gemma3"))
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, log_to_driver=False, configure_logging=False)
    remote = RayBackend(CONFIG, [Placement(path, "vl", samplers=0)])
    local = InProcessBackend.start(CONFIG, [])
    local.load_model(path, alias="vl")
    yield remote, local
    remote.close()
    if started:
        ray.shutdown()


def test_images_through_ray_equal_in_process(backends):
    remote, local = backends
    assert remote.models["vl"].vision and local.models["vl"].vision
    n = 5 + 4 + 4 + 4 + 3  # _chunked: 12 text tokens and two 4-position images
    request = ForwardRequest(None, [Datum(_chunked(1), {"target_tokens": _tokens(n, 2)})], base_model="vl")
    assert remote.validate(request, False) == local.validate(request, False) == Checked([n], [n])
    (a,), (b,) = remote.run_batch([request], False), local.run_batch([request], False)
    assert not isinstance(a, Failure) and not isinstance(b, Failure), (a, b)
    torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs),
                               atol=1e-6, rtol=0)
    seqs = [[_tokens(3, 1), _image(3), _tokens(2, 4)]]
    (ours,), (theirs,) = (b.compute_logprobs(seqs, Weights(base_model="vl")) for b in (remote, local))
    assert [v is None for v in ours] == [v is None for v in theirs] and sum(v is None for v in ours) == 5
    assert all(a == pytest.approx(b, abs=1e-6) for a, b in zip(ours, theirs) if a is not None)
    results = []
    for backend in (remote, local):
        backend.submit_sample("s", seqs[0], SamplingParams(max_tokens=4, temperature=0.0, stop=()),
                              Weights(base_model="vl"))
        done = []
        while not done:
            done = [r for rid, r in backend.sample_step() if rid == "s" and not hasattr(r, "take")
                    and hasattr(r, "sequences")]
        results.append(done[0].sequences[0].tokens)
    assert results[0] == results[1]
