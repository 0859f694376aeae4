"""No store call on the event loop through the real tinker SDK (issue 31, item 11): forward_backward with a server-side
custom loss (its definition read, the operation inserted), create_model, retrieve_future, load_weights both ways and
a session's close call the store on worker threads only (tests/service/test_store_off_loop.py wraps the store)."""

from __future__ import annotations

from tests.service.test_store_off_loop import calls_on_the_loop
from tests.tinker.test_custom_loss_sdk import advantage_weighted, items, tinker_data


def test_the_tinker_routes_call_the_store_off_the_loop(tinker_env, tiny_llama, monkeypatch):
    import tinker
    from tinker import types

    on_loop = calls_on_the_loop(monkeypatch, tinker_env.app.state.whitney.store)
    service = tinker.ServiceClient()
    handle = service.create_custom_loss(advantage_weighted, {"logprobs": 1, "advantages": 1}).result()
    tc = service.create_lora_training_client(base_model=tiny_llama, rank=4, seed=5).result()
    tc.forward_backward_custom(tinker_data(items(), ("advantages",)), handle).result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("off-loop").result().path
    assert tc.load_state(path).result().path == path
    service.create_training_client_from_state(path).result()
    service.close("success").result()
    assert on_loop == [], f"store calls made on the event loop: {sorted(set(on_loop))}"
