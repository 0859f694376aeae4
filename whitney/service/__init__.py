"""Whitney's service layer: HTTP routes (fastapi), the durable store (sqlalchemy), the scheduler.

It never imports torch: it hands plain data to `whitney.engine` and gets plain data back.
"""
