"""Row 1, the vocabulary: the mesh and its replica axis, values (`PerReplica`, `ReduceOp`), leaf
kinds, the scope and replica contexts, devices, platform set-up, lowering, capture detection, the
registry that optional frameworks fill (hooks) and process-wide settings. Imports nothing of
mirrored above it."""
