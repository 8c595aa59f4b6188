"""Per-replica random streams, the CPU kernels that draw from them, and their replay."""
