"""Datums for the Whitney HTTP API, and a tool to turn prompt/completion pairs into a batch.json.

`sft_datum` is a stdlib port of tinker_cookbook's create_rightshifted_model_input_and_leftshifted_targets
(it lives in `whitney.datums`, which has no dependencies beyond the standard library).

    python examples/training/http/whitney_datums.py pairs.jsonl batch.json [--model NAME_OR_DIR]

reads JSON lines {"prompt": "...", "completion": "..."} (or {"messages": [...]}), has the server render each
conversation with the served model's own tokenizer and chat template (POST /v1/chat/render: the completion's
end-of-turn tokens are the template's own), and writes the ForwardPayload that sl_loop.py sends. The server is
$WHITNEY_BASE_URL (default http://127.0.0.1:8000), with $WHITNEY_API_KEY when it needs a key.
"""

from __future__ import annotations

import argparse
import json
import os

from whitney.datums import chat_datum, render_chat, rl_datum, sft_datum, soft_target_datum, tensor

__all__ = ["chat_datum", "render_chat", "rl_datum", "sft_datum", "soft_target_datum", "tensor"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", help="JSON lines of {prompt, completion} or {messages}")
    parser.add_argument("out", help="where to write batch.json")
    parser.add_argument("--model", default=None, help="the served model whose template renders (default: the "
                                                      "server's first)")
    parser.add_argument("--base-url", default=os.environ.get("WHITNEY_BASE_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("WHITNEY_API_KEY"))
    args = parser.parse_args()
    data = []
    with open(args.pairs) as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            messages = item.get("messages") or [{"role": "user", "content": item["prompt"]},
                                                {"role": "assistant", "content": item["completion"]}]
            data.append(chat_datum(render_chat(args.base_url, messages, args.model, args.api_key)))
    with open(args.out, "w") as f:
        json.dump({"data": data, "loss_function": "cross_entropy", "loss_config": {}}, f)
    print(f"wrote {len(data)} datums to {args.out}")


if __name__ == "__main__":
    main()
