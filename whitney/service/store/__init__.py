"""The durable store: tables (tables.py), typed records (records.py), one function per transaction
(database.py), and what hangs off it: packages, keys and quotas, projects, run metrics and samples, custom
losses, lifecycle (the statuses and their moves).
"""
