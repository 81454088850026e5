"""Pricing: what a choice costs on the hardware -- compute and collectives per mesh dimension, and the
exact parameter shards and FSDP traffic each rank holds and issues.
"""
