"""Model families: base models loaded once (model.py), one `Decoder` interface (decoder.py) that the fast
Llama/Qwen decoder (transformer.py) and the general Hugging Face path (general.py, experts.py, vision.py)
implement, per-row LoRA (lora.py), and a model's own tokenizer (chat.py) and offline names (hub_cache.py).
"""
