"""Data parallel: replicated, ZeRO-1 or FSDP gradients and optimizer state, mixed precision and
recomputation as plan sections, and HSDP's node-aligned dp_replicate x dp_shard splits.
"""
