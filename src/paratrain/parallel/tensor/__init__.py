"""Tensor parallelism: which Linears to shard (`plan`) and sharding them on DTensor with a check (`apply`)."""
