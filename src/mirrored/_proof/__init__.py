"""Row 5, proof of distribution: `verify`, its checks, `profile`."""
