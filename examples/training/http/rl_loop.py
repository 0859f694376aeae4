"""RL on a synthetic arithmetic task: group-relative advantages, importance_sampling or ppo.

Each step: save_weights_for_sampler -> sample a group of answers per question from that version ->
reward 1 for the right number, 0 otherwise -> advantage = reward - the group's mean -> datums with the
sampler's own log-probs -> forward_backward(loss) -> optim_step. The mean reward is printed per step.

    whitney serve &
    python examples/training/http/rl_loop.py --base-url http://127.0.0.1:8000 --steps 8
"""

from __future__ import annotations

import argparse
import os
import random
import re

import whitney
from whitney.datums import rl_datum


def question(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}? Answer with just the number.", a + b


def reward(text: str, answer: int) -> float:
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and int(numbers[0]) == answer else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("WHITNEY_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("WHITNEY_API_KEY"))
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--loss", choices=["importance_sampling", "ppo"], default="importance_sampling")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--questions", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=8, help="samples per question")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)  # the served name loads offline on the server's machine
    rng = random.Random(args.seed)
    client = whitney.Client(args.base_url, api_key=args.api_key)
    session = client.create_session(example="rl_loop")
    run = session.create_run(args.model, rank=16, seed=args.seed)
    rewards_by_step = []
    for step in range(args.steps):
        version = run.save_weights_for_sampler().result()["version"]
        batch, rewards = [], []
        futures = []
        for _ in range(args.questions):
            text, answer = question(rng)
            prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            futures.append((prompt, answer, run.sample(prompt, version, num_samples=args.group, max_tokens=8,
                                                       temperature=1.0, seed=rng.getrandbits(31))))
        for prompt, answer, future in futures:  # all groups sample concurrently in one batch
            sequences = future.result()["sequences"]
            group = [reward(tokenizer.decode(s["tokens"], skip_special_tokens=True), answer) for s in sequences]
            mean = sum(group) / len(group)
            rewards += group
            for s, r in zip(sequences, group):
                if r != mean:  # zero advantage: no signal
                    batch.append(rl_datum(prompt, s["tokens"], s["logprobs"], r - mean))
        if batch:
            run.forward_backward(batch, args.loss)
            run.optim_step(learning_rate=args.learning_rate).result()
        rewards_by_step.append(sum(rewards) / len(rewards))
        print(f"step {step}: mean reward {rewards_by_step[-1]:.3f} ({len(batch)} datums with signal)", flush=True)
    run.finish()
    session.close()
    half = max(1, len(rewards_by_step) // 2)
    print(f"mean reward: first half {sum(rewards_by_step[:half]) / half:.3f}, "
          f"last half {sum(rewards_by_step[half:]) / max(1, len(rewards_by_step) - half):.3f}")


if __name__ == "__main__":
    main()
