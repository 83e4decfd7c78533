"""Target adapters: one per model family, over the mlx-lm model."""
