"""The public APIs over one store and scheduler: native /v1 (native/), Tinker /api/v1 (tinker/), the
OpenAI-compatible routes (openai/); model inputs with images, checked at the edge (images.py).
"""
