"""The coordinator of a parameter-server job: its queue, remote values, per-worker data."""
