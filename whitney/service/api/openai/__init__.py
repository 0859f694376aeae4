"""The OpenAI-compatible routes (routes.py), their wire models (schemas.py) and streamed text (text.py).
"""
