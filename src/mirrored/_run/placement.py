"""Where state and batches live: mirrored state must be replicated on exactly the strategy's
devices, split batches must be over its replicas; the errors that say how to fix either."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.leaves import type_kind as _type_kind
from mirrored._core.mesh import REPLICATED, is_per_replica_state
from mirrored._core.values import PerReplica


class Placement:
    """The placement checks of one strategy's devices (results cached per sharding)."""

    def __init__(self, devices: frozenset[Any], n: int, replicated: Any = None) -> None:
        self._devices = devices
        self._n = n
        self._replicated = replicated
        self._sharding_ok: dict[Any, bool] = {}

    def mirror_host_value(self, variable: nnx.Variable[Any]) -> jax.Array | None:
        """A Variable holding a host value (`nnx.Variable(0)`, a NumPy table, NumPy weights
        loaded with `nnx.update`) now holds it mirrored, as `nnx.jit` would place it; None
        when the value is no number or array."""
        value = variable.get_raw_value()
        if self._replicated is None or not isinstance(
            value, np.ndarray | np.generic | bool | int | float | complex
        ):
            return None
        host = np.asarray(value)
        if jax.process_count() > 1:  # the processes' values agree at the first step
            placed = jax.make_array_from_process_local_data(self._replicated, host)
        else:
            placed = jax.device_put(host, self._replicated)
        variable.set_raw_value(placed)
        return placed

    def is_mirrored(self, x: Any) -> bool:
        """Whether `x` is a jax.Array fully replicated on exactly this strategy's devices (a
        host value, a Python or NumPy number set between steps, is not yet)."""
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            return False
        ok = self._sharding_ok.get(sharding)
        if ok is None:
            ok = sharding.is_fully_replicated and sharding.device_set == self._devices
            self._sharding_ok[sharding] = ok
        return ok

    def sharded_spec(self, variable: Any, x: Any) -> Any:
        """The spec of a ShardedOptimizer's state leaf split over this strategy's replicas as
        its plan says (the Variable's `sharded` metadata), else None."""
        if not isinstance(variable, nnx.Variable) or not variable.has_metadata("sharded"):
            return None
        spec = variable.get_metadata("sharded")
        sharding = x.sharding
        if spec == REPLICATED or sharding.device_set != self._devices:
            return None
        return spec if getattr(sharding, "spec", None) == spec else None

    def is_per_replica(self, x: Any) -> bool:
        """Whether the jax.Array `x` is per-replica state: one row per replica, its leading
        axis split over this strategy's replicas (a replica's local gradient sum, say)."""
        sharding = x.sharding
        key = ("local", sharding)
        ok = self._sharding_ok.get(key)
        if ok is None:
            ok = is_per_replica_state(x) and sharding.device_set == self._devices
            self._sharding_ok[key] = ok
        return ok and x.ndim >= 1 and x.shape[0] == self._n

    def argument_error(self, args: Any, kwargs: Any, bad: Any) -> ValueError:
        name = "an argument"
        for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_leaf)[0]:
            if leaf is bad:
                where = "args" if path[0].idx == 0 else "kwargs"
                name = f"{where}{jax.tree_util.keystr(path[1:])}"
                break
        return self.not_mirrored_error(name, bad)

    def not_mirrored_error(self, name: str, bad: Any) -> ValueError:
        value = bad.get_raw_value() if isinstance(bad, nnx.Variable) else bad
        if isinstance(value, jax.Array):
            found = "devices " + ", ".join(sorted(str(d) for d in value.sharding.device_set))
            if not value.sharding.is_fully_replicated:
                found += f" (sharded as {value.sharding})"
        else:
            found = f"a host value of type {type(value).__name__}"
            arrays = [x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)]
            if arrays and not isinstance(value, jax.Array):
                return ValueError(
                    f"strategy.run expected each Variable to hold a single array; {name} "
                    f"({type(bad).__name__}) holds a {type(value).__name__} of {len(arrays)} "
                    "arrays (Optax's sm3 keeps its state so), not a single array, which "
                    "strategy.run does not support yet.\n"
                    "Fix: hold one array per Variable; for Optax, choose another optimizer "
                    "(optax.adafactor is a memory-light one)."
                )
        return ValueError(
            f"strategy.run expected mirrored state: every variable and jax.Array argument "
            f"replicated on this strategy's {self._n} device(s); {name} "
            f"({type(bad).__name__}) lives on {found}. It was most likely created outside "
            "strategy.scope().\n"
            "Fix: create models, optimizers and state inside the scope:\n"
            "  with strategy.scope():\n"
            "      model = MyModel(rngs=nnx.Rngs(0))\n"
            "      optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)\n"
            "(or pass a NumPy array for a constant input)."
        )

    def check_mirrored(self, obj: Any, label: str) -> None:
        """Raise the out-of-scope error for the first variable of `obj` not mirrored here."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(obj, is_leaf=_is_leaf)[0]:
            variable = _type_kind(type(leaf)) == "v"
            value = leaf.get_raw_value() if variable else leaf
            if variable and not isinstance(value, jax.Array):
                if not jax.tree.leaves(value):  # Optax's MaskedNode: nothing to place
                    continue
                value = self.mirror_host_value(leaf)
            if not (
                isinstance(value, jax.Array)
                and (
                    self.is_mirrored(value)
                    or (variable and self.is_per_replica(value))
                    or (variable and self.sharded_spec(leaf, value) is not None)
                )
            ):
                raise self.not_mirrored_error(f"{label}{jax.tree_util.keystr(path)}", leaf)

    def check_split(self, leaf: PerReplica) -> None:
        sharding = leaf.global_value.sharding
        ok = self._sharding_ok.get(("split", sharding))
        if ok is None:
            ok = sharding.device_set == self._devices
            self._sharding_ok[("split", sharding)] = ok
        if not ok or leaf.num_replicas != self._n:
            raise ValueError(
                f"strategy.run expected PerReplica values over this strategy's {self._n} "
                f"replicas; found one over {leaf.num_replicas} replica(s) on devices "
                f"{sorted(str(d) for d in sharding.device_set)}. Fix: distribute inputs and "
                "run steps with the same strategy."
            )
