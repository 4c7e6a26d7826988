"""Solve: XᵀX from the shards' partials, the damping rules and the regularized inverse of a checkpoint."""
