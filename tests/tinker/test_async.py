"""The SDK's deprecated *_async methods still in 0.38: each reaches the same endpoints as its sync twin."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

from tinker import types

from tests.tinker.helpers import arrays, close, sdk_logprobs, tinker_data

PROMPT = [1, 17, 250, 4000, 12, 99]


def test_async_methods(service_client, tiny_llama):
    warnings.simplefilter("ignore", FutureWarning)
    rest = service_client.create_rest_client()
    data = tinker_data(arrays("cross_entropy"))

    async def go() -> None:
        caps = await service_client.get_server_capabilities_async()
        assert caps.supported_models[0].model_name == Path(tiny_llama).name  # no server path
        tc = await service_client.create_lora_training_client_async(base_model=tiny_llama, rank=4, seed=9)
        assert (await tc.get_info_async()).lora_rank == 4
        forward = await (await tc.forward_async(data, "cross_entropy"))
        fb = await tc.forward_backward_async(data, "cross_entropy")
        step = await tc.optim_step_async(types.AdamParams(learning_rate=1e-2))
        close(sdk_logprobs(await fb), sdk_logprobs(forward))
        assert "grad_norm" in (await step).metrics

        def loss_fn(batch, logprobs):
            loss = sum(lp.sum() for lp in logprobs)
            return loss, {}

        custom = await (await tc.forward_backward_custom_async(data, loss_fn))
        assert "loss:sum" in custom.metrics
        path = (await (await tc.save_state_async("async-state"))).path
        await (await tc.load_state_async(path))
        await (await tc.load_state_with_optimizer_async(path))
        sampler_path = (await (await tc.save_weights_for_sampler_async("async-sampler"))).path
        sc = await tc.create_sampling_client_async(sampler_path)
        assert await sc.get_base_model_async() == tiny_llama
        logprobs = await sc.compute_logprobs_async(types.ModelInput.from_ints(PROMPT))
        sample = await sc.sample_async(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3, seed=1))
        assert len(sample.sequences[0].tokens) <= 3 and logprobs[0] is None
        ephemeral = await tc.save_weights_and_get_sampling_client_async()
        close((await ephemeral.compute_logprobs_async(types.ModelInput.from_ints(PROMPT)))[1:], logprobs[1:])
        by_path = await service_client.create_sampling_client_async(model_path=sampler_path)
        close((await by_path.compute_logprobs_async(types.ModelInput.from_ints(PROMPT)))[1:], logprobs[1:])
        resumed = await service_client.create_training_client_from_state_async(path)
        resumed_opt = await service_client.create_training_client_from_state_with_optimizer_async(path)
        for client in (resumed, resumed_opt):
            assert (await client.get_info_async()).model_id.startswith(service_client.holder.get_session_id())

        run = await rest.get_training_run_async(tc.model_id)
        assert run.training_run_id == tc.model_id
        assert (await rest.get_training_run_by_tinker_path_async(path)).training_run_id == tc.model_id
        listed = await rest.list_checkpoints_async(tc.model_id)
        assert {"weights/async-state", "sampler_weights/async-sampler"} <= {c.checkpoint_id for c in listed.checkpoints}
        assert path in {c.tinker_path for c in (await rest.list_user_checkpoints_async()).checkpoints}
        runs = (await rest.list_training_runs_async(limit=10_000)).training_runs  # every run, whatever ran before
        assert tc.model_id in {r.training_run_id for r in runs}
        session_id = service_client.holder.get_session_id()
        assert session_id in (await rest.list_sessions_async()).sessions
        session = await rest.get_session_async(session_id)
        sampler_ids = session.sampler_ids
        assert sampler_path in [(await rest.get_sampler_async(s)).model_path for s in sampler_ids]
        await rest.delete_checkpoint_async(tc.model_id, "sampler_weights/async-sampler")
        await rest.delete_checkpoint_from_tinker_path_async(path)
        left = {c.checkpoint_id for c in (await rest.list_checkpoints_async(tc.model_id)).checkpoints}
        assert not left & {"weights/async-state", "sampler_weights/async-sampler"}

    asyncio.run(go())
