"""Whitney: fine-tuning through training primitives, many LoRA runs on one shared base model.

`whitney.Client` talks to a server (`whitney serve`); `whitney.engine` is the in-process engine.
The client is imported on first use, so the engine alone never loads HTTP code.
"""

__version__ = "0.1.0"
__all__ = ["Client", "WhitneyAPIError"]


def __getattr__(name: str):
    if name in __all__:
        import whitney.client

        return getattr(whitney.client, name)
    raise AttributeError(name)
