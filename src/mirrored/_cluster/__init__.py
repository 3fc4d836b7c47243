"""Row 5, several processes: cluster resolvers, rendezvous, `MultiWorkerMirroredStrategy`, the
launcher."""
