"""Whitney's benchmark suite: `make bench` or `python -m bench [--quick] [--only NAME]`."""
