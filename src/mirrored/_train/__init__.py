"""Row 6, training: `Trainer`, its steps and objectives, Keras-named metrics, callbacks."""
