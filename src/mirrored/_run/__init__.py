"""Row 3, `strategy.run`: one cached SPMD program per call signature, and the path that calls it
(argument sorting, placement checks, program cache and compilation, dispatch, the fast-path guard,
`run_steps`, eager mode, the numerics monitor, errors)."""
