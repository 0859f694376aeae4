"""The scheduler: one worker thread drives the backend (scheduler.py, lanes.py); run queues in seq_id order,
fair training calls, sampling and scoring, saves, session and checkpoint expiry, each in its own module.
"""
