"""Moving tensors between replicas and workers: cross-device ops, buckets, the worker group."""
