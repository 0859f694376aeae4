"""The `whitney` command: demo (and, as the service lands, serve)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="whitney", description="Fine-tuning through training primitives.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a few SFT steps on the default model, loss going down")
    demo.add_argument("--model", default=None, help="base model name or local directory")
    demo.add_argument("--steps", type=int, default=12)
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--rank", type=int, default=16)
    demo.add_argument("--learning-rate", type=float, default=1e-3)
    args = parser.parse_args(argv)

    if args.command == "demo":
        from whitney.demo import run_demo
        from whitney.engine import DEFAULT_MODEL

        losses = run_demo(args.model or DEFAULT_MODEL, args.steps, args.batch_size, args.rank, args.learning_rate)
        return 0 if losses[-1] < losses[0] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
