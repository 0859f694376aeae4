"""A highly available service (`whitney serve --ha`): any number of API processes on one PostgreSQL database, one of
them scheduling under a lease with a fencing token (lease.py), submissions and answers through the database and its
notifications (dispatch.py, payloads.py, calls.py, notify.py), a dead leader's work taken over (inbox.py), each
process's role (member.py). docs/DEPLOY.md shows the setup and what each failure does.
"""
