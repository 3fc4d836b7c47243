"""Keras-style callbacks for `mirrored.Trainer`, one module per concept (as Keras splits them);
`mirrored.callbacks` re-exports them. Only the chief process prints and writes files."""
