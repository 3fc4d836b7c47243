"""mirrored: TensorFlow's MirroredStrategy programming model on JAX, Flax NNX and Optax."""

from mirrored import callbacks, config, debug, layers, losses, metrics, mixed_precision
from mirrored._cluster.multiworker import MultiWorkerMirroredStrategy
from mirrored._cluster.preemption import PreemptionCheckpointHandler, TerminationConfig
from mirrored._cluster.resolvers import (
    ClusterResolver,
    EnvironmentClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
)
from mirrored._core.context import ReplicaContext
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.platform import simulate_cpu_devices
from mirrored._core.values import PerReplica, ReduceOp, ValueContext
from mirrored._data.input import DistributedDataset, InputContext, InputOptions
from mirrored._optim.sharded import ShardedOptimizer
from mirrored._persist.checkpoint import (
    checkpoint_extras,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from mirrored._proof.checks import Check, Report
from mirrored._proof.profile import ProfileReport, profile
from mirrored._proof.verify import verify
from mirrored._run.errors import (
    HangError,
    PeerFailureError,
    PythonBranchError,
    ReplicaDivergenceError,
)
from mirrored._strategy.losses import compute_average_loss, scale_regularization_loss
from mirrored._strategy.strategy import (
    MirroredStrategy,
    OneDeviceStrategy,
    Strategy,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from mirrored._train.trainer import Trainer

__version__ = "0.1.0"

from mirrored import _keras_autoload

_keras_autoload.install()  # mirrored.keras, once Keras (JAX backend) is imported; never imports it

__all__ = [
    "REPLICA_AXIS",
    "Check",
    "ClusterResolver",
    "DistributedDataset",
    "EnvironmentClusterResolver",
    "HangError",
    "InputContext",
    "InputOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PeerFailureError",
    "PerReplica",
    "PreemptionCheckpointHandler",
    "ProfileReport",
    "PythonBranchError",
    "ReduceOp",
    "ReplicaContext",
    "ReplicaDivergenceError",
    "Report",
    "ShardedOptimizer",
    "SlurmClusterResolver",
    "Strategy",
    "TFConfigClusterResolver",
    "TerminationConfig",
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
