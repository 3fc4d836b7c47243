"""Row 2, persistence: Orbax checkpoints, complete or absent."""
