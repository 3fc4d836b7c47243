"""Row 9, the `mirrored` command: demo, bench, doctor."""
