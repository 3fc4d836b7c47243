"""Row 2, optimizers: mixed precision and loss scaling, reading and writing the learning rate."""
