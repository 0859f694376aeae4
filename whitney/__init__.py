"""Whitney: fine-tuning through training primitives, many LoRA runs on one shared base model."""

__version__ = "0.1.0"
