"""Row 4, the strategy: `Strategy`, its scope, `run`, `reduce`/`gather`, the current strategy,
`compute_average_loss`."""
