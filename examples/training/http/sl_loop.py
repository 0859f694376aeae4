"""A complete supervised loop over Whitney's HTTP API: forward_backward -> optim_step, in order.

Reads one ForwardPayload from --forward-backward-json (build one with whitney_datums.py), trains for
--steps steps, polling each operation to a terminal state before advancing seq_id, then save_state ->
export_lora -> finish -> close session, and downloads the LoRA adapter.

The server's `loss` is summed over tokens (docs/API.md). Each step prints it per token: divided by the
targets' total weight (a chat datum weighs 1 on each assistant token, 0 on the prompt: the loss per
completion token, as `whitney demo` shows it), or by the number of target tokens when a datum has no
weights; the sum follows, labelled.

    whitney serve &   # prints its URL
    python examples/training/http/whitney_datums.py examples/training/http/data/chats.jsonl batch.json
    python examples/training/http/sl_loop.py --base-url http://127.0.0.1:8000 --forward-backward-json batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import whitney


def loss_tokens(data: list[dict], metrics: dict) -> tuple[float, str]:
    """What a step's summed loss is divided by, and its name: the targets' total weight when every datum has
    weights, else the number of target tokens the loss counted."""
    weights = [d["loss_inputs"].get("weights") for d in data]
    if all(w is not None for w in weights):
        return float(sum(sum(w["values"]) for w in weights)), "weighted target tokens"
    return float(metrics["tokens:sum"]), "target tokens"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("WHITNEY_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("WHITNEY_API_KEY"))
    parser.add_argument("--provider", default="self-hosted",
                        help="where the server runs; Whitney is self-hosted, so this only labels the output")
    parser.add_argument("--model", default=None, help="base model (default: the server's first)")
    parser.add_argument("--forward-backward-json", required=True, help="a ForwardPayload: data, loss_function, loss_config")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--out", default="sl_loop_out", help="where the exported adapter is downloaded")
    args = parser.parse_args()

    with open(args.forward_backward_json) as f:
        batch = json.load(f)
    client = whitney.Client(args.base_url, api_key=args.api_key)
    caps = client.capabilities()
    missing = {"forward_backward", "optim_step", "save_state", "export_lora"} - set(caps["operations"])
    if missing:
        print(f"server lacks {sorted(missing)}", file=sys.stderr)
        return 1
    session = client.create_session(provider=args.provider)
    run = session.create_run(args.model, rank=args.rank)
    print(f"[{args.provider}] run {run.id} on {run.info['base_model']}")
    try:
        per_token = []
        for step in range(args.steps):
            fb = run.forward_backward(batch["data"], batch.get("loss_function", "cross_entropy"),
                                      **batch.get("loss_config", {})).result()
            opt = run.optim_step(learning_rate=args.learning_rate).result()
            tokens, name = loss_tokens(batch["data"], fb["metrics"])
            per_token.append(fb["loss"] / tokens if tokens else float("nan"))
            print(f"step {step}: loss per token {per_token[-1]:.4f} (summed loss {fb['loss']:.4f} over "
                  f"{tokens:g} {name})  grad_norm {opt['metrics']['grad_norm']:.4f}", flush=True)
        if per_token:
            print(f"loss per token: first step {per_token[0]:.4f}, last step {per_token[-1]:.4f}")
        state = run.save_state("final").result()["package"]
        lora = run.export_lora("final").result()["package"]
        run.finish()
        path = client.download_checkpoint(lora["id"], args.out)
        print(f"saved state {state['id']} (v{state['version']}); LoRA adapter in {path}")
        print(f"chat with it: the OpenAI endpoint's model {state['id']!r} (see examples/training/http/README.md)")
    except whitney.WhitneyAPIError:
        run.cancel()
        raise
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
