"""Projection: how a per-example gradient becomes a feature (random projections, the factored layout per layer, the
energy probe that splits proj_dim)."""
