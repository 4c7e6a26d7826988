"""Scoring: scores from features and the inverse, combined over checkpoints; the query index, top-k, token-level
explanations and data selection built on them."""
