"""Row 3, input: global batches split over the replicas, padding and masks, prefetching."""
