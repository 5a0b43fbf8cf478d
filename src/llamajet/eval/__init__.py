"""Evaluation: perplexity / KL on a corpus (perplexity.py), speed (bench.py)."""
