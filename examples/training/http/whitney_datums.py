"""Datums for the Whitney HTTP API, and a tool to turn prompt/completion pairs into a batch.json.

`sft_datum` is a stdlib port of tinker_cookbook's create_rightshifted_model_input_and_leftshifted_targets
(it lives in `whitney.datums`, which has no dependencies beyond the standard library).

    python examples/training/http/whitney_datums.py pairs.jsonl batch.json [--model NAME_OR_DIR]

reads JSON lines {"prompt": "...", "completion": "..."}, renders them with the model's chat template,
and writes the ForwardPayload that sl_loop.py sends.
"""

from __future__ import annotations

import argparse
import json

from whitney.datums import rl_datum, sft_datum, soft_target_datum, tensor

__all__ = ["rl_datum", "sft_datum", "soft_target_datum", "tensor"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pairs", help="JSON lines of {prompt, completion}")
    parser.add_argument("out", help="where to write batch.json")
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from whitney.engine.model import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    data = []
    with open(args.pairs) as f:
        for line in f:
            if not line.strip():
                continue
            pair = json.loads(line)
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": pair["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True)
            prompt_tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            completion_tokens = tokenizer(pair["completion"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
            data.append(sft_datum(prompt_tokens, completion_tokens))
    with open(args.out, "w") as f:
        json.dump({"data": data, "loss_function": "cross_entropy", "loss_config": {}}, f)
    print(f"wrote {len(data)} datums to {args.out}")


if __name__ == "__main__":
    main()
