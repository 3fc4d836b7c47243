"""Process-wide settings (TensorFlow's `tf.config` names where it has them).

**Persistent compilation cache.** Every process used to compile its programs from scratch.
mirrored turns on JAX's persistent compilation cache when the first strategy is created, in a
per-user directory, so that a second run of the same program loads its compiled steps from
disk instead of compiling them:

| setting                                   | cache                                          |
|-------------------------------------------|------------------------------------------------|
| nothing (the default)                     | `$XDG_CACHE_HOME/mirrored/xla` (`~/.cache/...`)|
| `MIRRORED_COMPILATION_CACHE=/some/dir`    | that directory                                 |
| `MIRRORED_COMPILATION_CACHE=0` (or `off`) | none                                           |
| `JAX_COMPILATION_CACHE_DIR` / JAX's config set by you | yours, left exactly as you set it  |
| `mirrored.config.set_compilation_cache(path or None)` | that directory / none, at any time |

Entries are written under a file lock and the directory is bounded (least recently used
entries go first beyond `MAX_CACHE_BYTES`), so the processes of a multi-worker job, or two
jobs, share one cache without corrupting it. The directory is scanned only when it may be
full: JAX's bounded cache scans every entry before each write, which at 10,000 entries cost
1.5 s per compiled program. Like any compilation cache it is trusted code:
do not point it at a directory others can write to.

**Device-resident data.** `Trainer(..., steps_per_execution=K > 1)`'s `fit` (training and
validation arrays), `evaluate` and `predict` on in-memory arrays read more than once per
replica (more epochs than replicas, or a second call on the same arrays) place them on every
device once and gather each batch there (the same batches, padding and masks as reading them
from the host), so K batches need no copy from the host, when all the arrays a trainer keeps
take at most `device_data_bytes()` per device (the least recently used leave first):
`DEVICE_DATA_BYTES` (1 GiB) unless `MIRRORED_DEVICE_DATA_BYTES` says otherwise (`0`: always
from the host). On CPU devices the default is `0`: each execution's K batches are gathered on
the host at once and placed without a copy, measured as fast as or faster than arrays kept on
the devices, and at a fraction of the memory (simulated CPU devices share the host's: eight
kept copies of 100 MB of data cost 840 MB, the host path 170 MB). Set the variable to keep
them on CPU devices too.

**Eager execution, for debugging.** `run_functions_eagerly(True)` (TensorFlow's
`tf.config.run_functions_eagerly`) makes `strategy.run`, `run_steps` and `Trainer.fit` /
`evaluate` / `predict` run the step op by op on the strategy's devices, without compiling it:
`print` shows each replica's value, `breakpoint()` stops inside the step, and Python `if` works
on values that are the same on every replica. The numbers are the compiled mode's.
`Trainer(..., run_eagerly=True)` does the same for one trainer (Keras' `compile` argument).
"""

from mirrored._core.settings import MAX_CACHE_BYTES as MAX_CACHE_BYTES
from mirrored._core.settings import (
    compilation_cache_dir,
    default_cache_dir,
    device_data_bytes,
    functions_run_eagerly,
    run_functions_eagerly,
    set_compilation_cache,
)
from mirrored._core.settings import (
    use_default_compilation_cache as use_default_compilation_cache,
)

__all__ = [
    "compilation_cache_dir",
    "default_cache_dir",
    "device_data_bytes",
    "functions_run_eagerly",
    "run_functions_eagerly",
    "set_compilation_cache",
]
