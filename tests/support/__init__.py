"""Test helpers: shared constants (common.py) and the helper processes the tests start (a fake hub, a
webhook receiver, multi-rank megatron workers)."""
