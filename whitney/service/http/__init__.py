"""HTTP plumbing shared by every API: the app's state and the caller (deps.py), error answers (handlers.py),
body checks (bodies.py, text.py), signed URLs (signing.py), Prometheus metrics (metrics.py).
"""
