"""Run the shared SDK benchmark with every LoRA training client created with train_unembed=False.

SkyRL tx trains attention and MLP adapters but not the unembedding, so Whitney is measured on the
same work. Nothing else changes: the script, the SDK and its calls are the official ones.

    python -m bench.peer_sdk PATH/TO/bench_sdk.py BASE_MODEL [bench_sdk.py options...]
"""

from __future__ import annotations

import runpy
import sys

import tinker


def main() -> None:
    create = tinker.ServiceClient.create_lora_training_client

    def without_unembed(self, *args, **kwargs):
        kwargs.setdefault("train_unembed", False)
        return create(self, *args, **kwargs)

    tinker.ServiceClient.create_lora_training_client = without_unembed
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
