"""Training: the `Engine` (runs.py) over runs (run.py), one forward/backward batch (batch.py) in passes
(passes.py), requests checked (requests.py), AdamW (optim.py), checkpoints (checkpoint.py) and sharded bases
(sharded.py, sharded_checkpoint.py).
"""
