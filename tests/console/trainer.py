"""A training loop over the real HTTP API, in a background thread, for the console to watch."""

from __future__ import annotations

import math
import threading
import time

from whitney import Client
from whitney.datums import sft_datum

# Chat-like SFT examples in SmolLM2 token ids (the tiny model has the real tokenizer's vocabulary).
EXAMPLES = [([1, 523, 1077, 2889, 30], [905, 3211, 17, 2]),
            ([1, 77, 4402], [12, 9983, 451, 31000, 2]),
            ([1, 8, 9, 10, 11, 12, 13], [14, 15, 2])]


class Trainer(threading.Thread):
    """SFT on a tiny batch: forward_backward and optim_step each step, an evaluation forward every
    `eval_every` steps, a sampler version every `version_every` steps and one saved state, then
    `steps_delay` seconds between steps so that a watcher sees the run move. After each step it logs a reward
    as an RL loop would (computed here, from the step's own result: each datum's mean token probability),
    `reward/mean` and `reward/min`, at the run's current optimizer step (the route's default); and with each
    evaluation, the batch's examples as samples (a prompt, its completion and that datum's reward), kept in
    `samples` as logged."""

    def __init__(self, url: str, api_key: str | None = None, steps: int = 40, step_delay: float = 0.25,
                 version_every: int = 10, eval_every: int = 5, lr: float = 5e-3):
        super().__init__(daemon=True, name="console-trainer")
        self.client = Client(url, api_key=api_key)
        self.steps, self.step_delay, self.version_every, self.eval_every, self.lr = (
            steps, step_delay, version_every, eval_every, lr)
        self.run_id: str | None = None
        self.session_id: str | None = None
        self.losses: list[float] = []
        self.rewards: list[tuple[int, float, float]] = []  # (step, mean, min) as logged
        self.samples: dict[int, list[dict]] = {}  # step -> the samples logged at it
        self.versions: list[int] = []
        self.state_id: str | None = None
        self.done_steps = 0
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            session = self.client.create_session(purpose="console-test")
            run = session.create_run(rank=8, alpha=16.0, experiment="sft-demo")
            self.session_id, self.run_id = session.id, run.id
            self.ready.set()
            batch = [sft_datum(p, c) for p, c in EXAMPLES]
            for step in range(1, self.steps + 1):
                if self.stopping.is_set():
                    break
                fb = run.forward_backward(batch, "cross_entropy")
                run.optim_step(learning_rate=self.lr * (1 - 0.5 * step / self.steps), gradient_clip_norm=10.0).result()
                result = fb.result()
                self.losses.append(result["loss"])
                # mean token probability of each datum's completion (the prompt's positions carry no loss)
                completions = [[x for x in o["elementwise_loss"] if x] for o in result["outputs"]]
                probs = [math.exp(-sum(c) / len(c)) for c in completions]
                logged = run.log_metrics({"reward/mean": sum(probs) / len(probs), "reward/min": min(probs)})
                self.rewards.append((logged["step"], logged["metrics"]["reward/mean"], logged["metrics"]["reward/min"]))
                if step % self.eval_every == 0:
                    run.forward(batch[:1], "cross_entropy").result()
                    samples = [{"prompt": f"example {i}: tokens {p}", "completion": f"tokens {c}\nstep {step}",
                                "reward": prob, "metadata": {"datum": i, "tokens": len(c)}}
                               for i, ((p, c), prob) in enumerate(zip(EXAMPLES, probs))]
                    self.samples[run.log_samples(samples)["step"]] = samples
                if step % self.version_every == 0:
                    self.versions.append(run.save_weights_for_sampler().result()["version"])
                if step == self.version_every:
                    self.state_id = run.save_state("checkpoint").result()["package"]["id"]
                self.done_steps = step
                time.sleep(self.step_delay)  # the point: a paced run that the console's tests watch move (docstring)
        except BaseException as e:  # the test reports it
            self.error = e
            self.ready.set()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=60)
        self.client.close()
