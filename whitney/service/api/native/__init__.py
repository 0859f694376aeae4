"""The native /v1 API: one router per resource (sessions, operations, sampling, checkpoints, capabilities,
custom losses, run metrics and samples) and its wire models (schemas.py)."""
