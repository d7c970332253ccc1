"""Memory-saving transformations applied to a built model from outside (activation recompute)."""
