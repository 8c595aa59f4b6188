"""The ps and worker tasks of a parameter-server job: shards, updates, rpc."""
