"""Evaluation: AIME-style metrics (avg@n, pass@k, maj@n) over sampled responses."""
