"""Featurize: model outputs, per-example gradients and the featurizer that writes projected rows (memory budget,
sharded models, adapters)."""
