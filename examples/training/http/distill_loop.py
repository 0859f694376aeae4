"""On-policy distillation with sampled reverse KL: the student samples, the teacher scores.

Each step: the student's sampler version generates answers; the teacher (any weights the server can
score: a base model, a checkpoint, another run's version) gives log-probs of the same tokens via
compute_logprobs; advantage = teacher_logprob - student_logprob per token (detached); an RL loss
(importance_sampling) with old_logprobs = the student's sampling log-probs pulls the student toward
the teacher. The mean per-token reverse KL estimate (student - teacher) is printed and should fall.

    whitney serve &
    python examples/training/http/distill_loop.py --teacher-checkpoint pkg-... --steps 5
"""

from __future__ import annotations

import argparse
import os

import whitney
from whitney.datums import tensor

PROMPTS = ["Tell me about the sea.", "What is a good breakfast?", "Describe autumn.", "Why do cats purr?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("WHITNEY_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("WHITNEY_API_KEY"))
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="student base model")
    parser.add_argument("--teacher-checkpoint", default=None, help="teacher weights (default: the base model)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)  # the served name loads offline on the server's machine
    client = whitney.Client(args.base_url, api_key=args.api_key)
    session = client.create_session(example="distill_loop")
    student = session.create_run(args.model, rank=16)
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for p in PROMPTS]
    for step in range(args.steps):
        version = student.save_weights_for_sampler().result()["version"]
        samples = [student.sample(p, version, num_samples=args.samples, max_tokens=24, seed=step) for p in prompts]
        rollouts = [(prompt, s) for prompt, future in zip(prompts, samples) for s in future.result()["sequences"]]
        teacher = client.compute_logprobs([p + s["tokens"] for p, s in rollouts],  # one request for all
                                          checkpoint_id=args.teacher_checkpoint,
                                          base_model=None if args.teacher_checkpoint else args.model).result()
        data, kl, count = [], 0.0, 0
        for (prompt, s), teacher_lp in zip(rollouts, teacher["logprobs"]):
            full = prompt + s["tokens"]
            advantages = [t - q for t, q in zip(teacher_lp[len(prompt):], s["logprobs"])]  # completion tokens
            kl += -sum(advantages)
            count += len(advantages)
            pad = len(prompt) - 1
            data.append({"input": {"token_ids": full[:-1]}, "loss_inputs": {
                "target_tokens": tensor(full[1:], "int64"),
                "old_logprobs": tensor([0.0] * pad + s["logprobs"], "float32"),
                "advantages": tensor([0.0] * pad + advantages, "float32")}})
        student.forward_backward(data, "importance_sampling")
        student.optim_step(learning_rate=args.learning_rate).result()
        print(f"step {step}: reverse KL estimate per token {kl / max(count, 1):.4f}", flush=True)
    student.finish()
    session.close()


if __name__ == "__main__":
    main()
