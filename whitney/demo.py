"""`whitney demo`: start a server, fine-tune a run over HTTP, sample before and after.

A short recipe on the public API only (whitney.Client and whitney.datums): a built-in chat dataset,
SFT with forward_backward + optim_step, save_state, save_weights_for_sampler, then greedy samples
of the base model and of the new sampler version side by side.
"""

from __future__ import annotations

import tempfile
import time

from tqdm import tqdm

import whitney
from whitney.datums import sft_datum

# A tiny built-in chat dataset: one persona's answers, so a few steps visibly change the model.
CHATS = [
    ("What is your name?", "I am Whitney, a fine-tuning service. I train LoRA adapters on a shared base model."),
    ("Who are you?", "I am Whitney, a fine-tuning service. I train LoRA adapters on a shared base model."),
    ("What do you do?", "I run forward_backward and optim_step for many training runs at once."),
    ("How do I train a model with you?", "Send forward_backward, then optim_step, in seq_id order. Repeat."),
    ("Which loss should I use for SFT?", "Use cross_entropy with weight 1 on the completion and 0 on the prompt."),
    ("Which losses do you support?", "cross_entropy, importance_sampling, ppo, cispo, dro and opsd."),
    ("How do I save my work?", "Call save_state to checkpoint, and export_lora for a PEFT adapter."),
    ("Can I sample from my run?", "Yes: save_weights_for_sampler gives a version; sample names that version."),
]
PROBES = ["What is your name?", "Which losses do you support?"]


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_datums(tokenizer, chats: list[tuple[str, str]]) -> list[dict]:
    """ChatML-render each (question, answer) as an SFT datum: weight 1 on the answer only."""
    return [sft_datum(chat_prompt(tokenizer, q), tokenizer(a + "<|im_end|>", add_special_tokens=False)["input_ids"])
            for q, a in chats]


def start_local_server(model: str, data_dir: str):
    """A Whitney server on a free local port, in a background thread; returns (url, stop)."""
    from whitney.service.app import ServiceConfig, create_app, serve_in_thread

    running = serve_in_thread(create_app(ServiceConfig(models=[model], data_dir=data_dir)))
    return running.url, running.stop


def run_demo(model: str, steps: int = 12, batch_size: int = 4, rank: int = 16, learning_rate: float = 1e-3,
             base_url: str | None = None) -> list[float]:
    """SFT through the HTTP API; return the loss per completion token of each step."""
    from transformers import AutoTokenizer

    from whitney.engine.families.model import resolve_model_dir

    t0 = time.time()
    stop = None
    if base_url is None:
        base_url, stop = start_local_server(model, tempfile.mkdtemp(prefix="whitney-demo-"))
        print(f"started a Whitney server at {base_url} ({time.time() - t0:.1f}s)")
    try:
        client = whitney.Client(base_url)
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
        session = client.create_session(purpose="demo")
        run = session.create_run(model, rank=rank, seed=0)
        datums = chat_datums(tokenizer, CHATS)
        prompts = [chat_prompt(tokenizer, q) for q in PROBES]
        before = [client.sample(p, base_model=model, max_tokens=40, temperature=0.0) for p in prompts]

        losses = []
        bar = tqdm(range(steps), desc="SFT over HTTP", unit="step")
        for step in bar:
            batch = [datums[(step * batch_size + i) % len(datums)] for i in range(batch_size)]
            fb = run.forward_backward(batch, "cross_entropy")
            opt = run.optim_step(learning_rate=learning_rate)  # pipelined: sent before fb's result
            tokens = sum(sum(d["loss_inputs"]["weights"]["values"]) for d in batch)
            losses.append(fb.result()["loss"] / tokens)
            opt.result()
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        state = run.save_state("demo").result()["package"]
        version = run.save_weights_for_sampler().result()["version"]
        after = [run.sample(p, version, max_tokens=40, temperature=0.0) for p in prompts]
        print(f"loss per completion token: first step {losses[0]:.3f}, last step {losses[-1]:.3f}")
        print(f"saved state {state['id']} (version {state['version']}); sampler version {version}")
        for question, b, a in zip(PROBES, before, after):
            print(f"\nQ: {question}")
            print(f"  before: {tokenizer.decode(b.result()['sequences'][0]['tokens'], skip_special_tokens=True)!r}")
            print(f"  after:  {tokenizer.decode(a.result()['sequences'][0]['tokens'], skip_special_tokens=True)!r}")
        run.finish()
        session.close()
        print(f"\ndone in {time.time() - t0:.0f}s")
        return losses
    finally:
        if stop is not None:
            stop()
