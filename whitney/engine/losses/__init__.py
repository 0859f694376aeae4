"""Losses: the table (table.py, builtin.py), opsd, custom graphs (custom.py: checked;
custom_run.py: planned from a datum's shapes, budgeted per request, run), datums as tensors (datum.py) and
target log-probs straight from hidden rows (unembedding.py).
"""
