"""Issue 31, item 10, through the unmodified Tinker SDK: a sampling future the client cancels is cancelled on the
server (the SDK sends cancel_future for an abandoned sample once the server's dynamic config enables it), which
stops decoding it within a step and frees its cache."""

from __future__ import annotations

from tinker import types

from tests.service.test_sample_cancel import MAX_TOKENS, N, Watch


def test_a_cancelled_sampling_future_stops_the_sample(service_client, tinker_server, tiny_llama, monkeypatch):
    watch = Watch(tinker_server, monkeypatch)
    sampler = service_client.create_sampling_client(base_model=tiny_llama).result()
    future = sampler.sample(types.ModelInput.from_ints([1, 17, 250]), N,
                            types.SamplingParams(max_tokens=MAX_TOKENS, seed=4, stop=[]))
    watch.until(lambda: any(watch.rows(op_id) for op_id in list(watch.requests)), "the sample never decoded")
    (op_id,) = watch.requests
    watch.gone(op_id)
    future.future().cancel()  # the caller gives the future up
    watch.check_stopped_and_freed(op_id, "cancelled by the client (cancel_future)")
