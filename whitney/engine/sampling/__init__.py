"""Sampling: one continuous-batching core (sampler.py) over a cache strategy (kv_cache.py for the fast
families, hf_sampler.py for a model's own cache), per-request rows (rows.py) and prompt scores.
"""
