"""mirrored: TensorFlow's MirroredStrategy programming model on JAX, Flax NNX and Optax."""

from mirrored import callbacks, config, debug, layers, losses, metrics, mixed_precision
from mirrored._checkpoint import (
    checkpoint_extras,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from mirrored._context import ReplicaContext
from mirrored._input import DistributedDataset, InputContext, InputOptions
from mirrored._losses import compute_average_loss, scale_regularization_loss
from mirrored._mesh import REPLICA_AXIS
from mirrored._multiworker import (
    ClusterResolver,
    EnvironmentClusterResolver,
    MultiWorkerMirroredStrategy,
    SlurmClusterResolver,
    TFConfigClusterResolver,
)
from mirrored._platform import simulate_cpu_devices
from mirrored._profile import ProfileReport, profile
from mirrored._run import PeerFailureError, PythonBranchError, ReplicaDivergenceError
from mirrored._strategy import (
    MirroredStrategy,
    OneDeviceStrategy,
    Strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from mirrored._trainer import Trainer
from mirrored._values import PerReplica, ReduceOp, ValueContext
from mirrored._verify import Check, Report, verify

__version__ = "0.1.0"

from mirrored import _keras_hook

_keras_hook.install()  # mirrored.keras, once Keras (JAX backend) is imported; never imports it

__all__ = [
    "REPLICA_AXIS",
    "Check",
    "ClusterResolver",
    "DistributedDataset",
    "EnvironmentClusterResolver",
    "InputContext",
    "InputOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "PerReplica",
    "ProfileReport",
    "PythonBranchError",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaDivergenceError",
    "Report",
    "SlurmClusterResolver",
    "Strategy",
    "TFConfigClusterResolver",
    "Trainer",
    "ValueContext",
    "callbacks",
    "checkpoint_extras",
    "compute_average_loss",
    "config",
    "debug",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "latest_checkpoint",
    "layers",
    "losses",
    "metrics",
    "mixed_precision",
    "profile",
    "restore_checkpoint",
    "save_checkpoint",
    "scale_regularization_loss",
    "simulate_cpu_devices",
    "verify",
]
