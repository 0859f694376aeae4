"""The names Whitney hands out load offline on the serving machine (HF_HUB_OFFLINE=1): the official SDK's
`get_tokenizer()` (training and sampling clients) and `from_pretrained(base_model_name_or_path)` of an exported
PEFT adapter, for a model served from a directory and for the embedded SmolLM2 (engine/hub_cache.py).

The adapter loaded by name must reproduce the server's own log-probs: the base found by name is the base that
was served, not merely a model of that name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import whitney
from whitney.datums import sft_datum


def _trained_adapter(url: str, base_model: str, dest: Path, prompt: list[int], answer: list[int]):
    """A run on `base_model` trained one step, its sampler version's log-probs of prompt + answer (server
    side), and its PEFT export downloaded under dest."""
    with whitney.Client(url, timeout=300) as client:
        session = client.create_session()
        run = session.create_run(base_model, rank=4, seed=3)
        run.forward_backward([sft_datum(prompt, answer)], "cross_entropy")
        run.optim_step(learning_rate=1e-2).result()
        version = run.save_weights_for_sampler().result()["version"]
        served = run.compute_logprobs([prompt + answer], version).result()["logprobs"][0]
        package = run.export_lora("offline").result()["package"]
        folder = client.download_checkpoint(package["id"], str(dest))
        session.close()
    return served, Path(folder)


def _local_logprobs(adapter: Path, tokens: list[int]) -> list[float]:
    """The adapter loaded the way its user would (the base by base_model_name_or_path): log-probs of tokens[1:]."""
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()  # [T, V]
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]  # [T-1]
    return lp.tolist()


def _check_by_name(name: str, served_dir: Path, url: str, service_client, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(served_dir)
    text = "Whitney trains LoRA adapters."
    tc = service_client.create_lora_training_client(base_model=name, rank=4).result()
    assert tc.get_info().model_data.tokenizer_id == name
    assert tc.get_tokenizer().encode(text) == reference.encode(text)
    sampler = service_client.create_sampling_client(base_model=name).result()
    assert sampler.get_tokenizer().encode(text) == reference.encode(text)

    prompt, answer = reference.encode("Who are you?"), reference.encode(" I am Whitney.")
    served, adapter = _trained_adapter(url, name, tmp_path, prompt, answer)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == name
    local = _local_logprobs(adapter, prompt + answer)
    assert served[0] is None and len(served) == len(local) + 1
    assert torch.allclose(torch.tensor(served[1:]), torch.tensor(local), atol=1e-4, rtol=1e-4), \
        "the base loaded by name is not the base that was served"


def test_a_directory_models_served_name_loads_offline(service_client, tinker_env, tiny_llama, tmp_path):
    name = Path(tiny_llama).name  # served under the directory's own name, never its path
    _check_by_name(name, Path(tiny_llama), tinker_env.url, service_client, tmp_path)


@pytest.mark.slow
def test_the_embedded_models_hub_id_loads_offline(tmp_path, monkeypatch):
    import tinker

    from bench.common import start_server
    from whitney.engine.families.model import embedded_model_dir
    from whitney.protocol.config import DEFAULT_MODEL

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with start_server() as server:  # whitney serve with its default model, in its own process
        client = tinker.ServiceClient(base_url=server.url, api_key="tml-offline-names")
        try:
            _check_by_name(DEFAULT_MODEL, embedded_model_dir(), server.url, client, tmp_path)
        finally:
            client.close("success").result()
