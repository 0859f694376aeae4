"""The OpenAI-compatible endpoint on the Ray backend: the chat template and tokenizer reach the control plane
from the trainer (fetched once), and a streamed answer from a sampler replica equals the whole one."""

from __future__ import annotations

import openai
from transformers import AutoTokenizer

from tests.cluster.conftest import ray_config
from tests.service.conftest import start_server


def test_chat_render_and_streaming_on_ray(ray_cluster, tiny_llama, tmp_path):
    server = start_server(ray_config(ray_cluster, [tiny_llama], tmp_path / "data"))
    try:
        name = tiny_llama.rsplit("/", 1)[-1]
        tok = AutoTokenizer.from_pretrained(tiny_llama)
        messages = [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}]
        with server.http() as http:
            rendered = http.post("/v1/chat/render", json={"model": tiny_llama, "messages": messages}).json()
        assert rendered["model"] == name  # a directory is shown by its name
        assert rendered["tokens"] == tok(tok.apply_chat_template(messages, tokenize=False),
                                         add_special_tokens=False)["input_ids"]
        masked = [t for t, m in zip(rendered["tokens"], rendered["assistant_mask"]) if m]
        assert tok.decode(masked) == "yes<|im_end|>\n"

        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        common = dict(model=name, messages=messages[:1], seed=7, max_tokens=30, n=2, logprobs=True)
        whole = client.chat.completions.create(**common)
        texts, logprobs = {0: "", 1: ""}, {0: [], 1: []}
        for chunk in client.chat.completions.create(**common, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                logprobs[choice.index] += [c.logprob for c in (choice.logprobs.content if choice.logprobs else [])]
        for choice in whole.choices:
            assert texts[choice.index] == choice.message.content
            assert logprobs[choice.index] == [c.logprob for c in choice.logprobs.content]
    finally:
        server.stop()
