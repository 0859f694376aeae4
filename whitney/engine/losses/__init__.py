"""Losses: the table (table.py, builtin.py), opsd, custom graphs (custom.py), datums as tensors (datum.py) and
target log-probs straight from hidden rows (unembedding.py).
"""
