"""``mirrored launch``: starting and supervising a job's worker processes."""
