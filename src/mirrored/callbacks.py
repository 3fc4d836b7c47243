"""Keras-style callbacks for `mirrored.Trainer`: history, progress, checkpoints, logs, rates.

Only the chief process (process 0) prints and writes files.
"""

from mirrored._train.callbacks.base import Callback, History
from mirrored._train.callbacks.checkpoints import BackupAndRestore, ModelCheckpoint
from mirrored._train.callbacks.learning_rate import LearningRateScheduler, ReduceLROnPlateau
from mirrored._train.callbacks.logs import CSVLogger, LambdaCallback
from mirrored._train.callbacks.monitoring import EarlyStopping, TerminateOnNaN
from mirrored._train.callbacks.progress import ProgbarLogger
from mirrored._train.callbacks.tensorboard import TensorBoard

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
]
