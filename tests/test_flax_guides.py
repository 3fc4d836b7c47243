"""Issue 34, item 7 (Flax half of the hunt): recipes of Flax's NNX guides as their users write
them — the optimization cookbook, transforms, filters, surgery, the Linen bridge, pytrees,
views, intermediates, dtypes, checkpointing, transfer learning — made in the scope, three
steps (the last ragged) on 8 replicas against `nnx.jit` on one device with the same global
batches. The one change a recipe gets is mirrored's documented one: its mean loss is
`compute_average_loss` of the per-example terms (a sum stays a sum: the gradient of each
replica's sum, summed over the replicas, is the global sum's).

Some cannot match, by their nature (asserted, so that a change is noticed): see CANNOT_MATCH.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import mirrored
from mirrored.layers import SyncBatchNorm

RNG = np.random.default_rng(19)
X = RNG.normal(size=(21, 6)).astype(np.float32)  # global batches of 8, 8 and a ragged 5
Y = RNG.normal(size=(21, 4)).astype(np.float32)
BATCHES = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 21, 8)]
LR = 1e-2

Reduce = Callable[[Any], Any]  # per-example terms -> the loss: mean, or compute_average_loss


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, **kwargs: Any):
        self.hidden = nnx.Linear(6, 8, rngs=rngs, **kwargs)
        self.out = nnx.Linear(8, 4, rngs=rngs, **kwargs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


def _squared_error(model, x, y):
    return jnp.mean((model(x) - y) ** 2, axis=-1)


def _default_step(model, optimizer, extra, x, y, reduce: Reduce):
    loss, grads = nnx.value_and_grad(lambda m: reduce(_squared_error(m, x, y)))(model)
    optimizer.update(model, grads)
    return loss


@dataclass(frozen=True)
class Recipe:
    build: Callable[[], tuple[nnx.Module, nnx.Optimizer, Any]]  # model, optimizer, extra state
    step: Callable[..., Any] = _default_step
    tolerance: float = 2e-5  # relative to the largest value compared


# --- the optimization cookbook -------------------------------------------------------------


class Ema(nnx.Module):
    """The cookbook's exponential moving average, as written: a copy of the model, replaced
    by a new tree every step."""

    def __init__(self, model, decay=0.9):
        self.decay = decay
        self.ema = jax.tree.map(jnp.copy, model)

    def update(self, model):
        def ema_update(ema, new_val):
            return self.decay * ema + (1 - self.decay) * new_val

        self.ema = jax.tree.map(ema_update, self.ema, model)


def _cookbook_sequential(rngs):
    init = jax.nn.initializers.lecun_normal()
    return nnx.Sequential(
        nnx.Linear(6, 8, rngs=rngs, kernel_init=init), nnx.Linear(8, 4, rngs=rngs, kernel_init=init)
    )


def _sum_of_squares(model, x, y, reduce: Reduce):
    """The cookbook's loss, `jnp.sum((model(x) - y) ** 2)`; under mirrored the sum of the
    replica's real rows (a ragged batch's padded rows are copies: masked, as mirrored's
    warning says)."""
    per_example = jnp.sum((model(x) - y) ** 2, axis=-1)
    if reduce is jnp.mean:  # one device
        return jnp.sum(per_example)
    mask = mirrored.get_replica_context().example_mask
    return jnp.sum(jnp.where(mask, per_example, 0.0))


def _sum_of_squares_step(model, optimizer, extra, x, y, reduce: Reduce):
    loss, grads = nnx.value_and_grad(lambda m: _sum_of_squares(m, x, y, reduce))(model)
    optimizer.update(model, grads)
    return loss


def _ema():
    model = _cookbook_sequential(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), Ema(model)


def _ema_step(model, optimizer, ema, x, y, reduce: Reduce):
    loss = _sum_of_squares_step(model, optimizer, None, x, y, reduce)
    ema.update(model)
    return loss


def _lora():
    rngs = nnx.Rngs(0)

    def add_rank2_lora(path, node):
        if isinstance(node, nnx.Linear):
            return nnx.LoRA(node.in_features, 2, node.out_features, base_module=node, rngs=rngs)
        return node

    model = nnx.recursive_map(add_rank2_lora, _cookbook_sequential(rngs))
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.LoRAParam), None


def _lora_step(model, optimizer, extra, x, y, reduce: Reduce):
    diff = nnx.DiffState(0, nnx.LoRAParam)
    loss_fn = functools.partial(_sum_of_squares, x=x, y=y, reduce=reduce)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
    optimizer.update(model, grads)
    return loss


def _per_parameter_rates():
    model = _cookbook_sequential(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    rates = {"kernel": optax.adam(1e-3), "bias": optax.adam(1e-2)}
    param_tys = nnx.map_state(lambda p, v: list(p)[-1], state)
    tx = optax.partition(rates, param_tys)
    return model, nnx.Optimizer(model, tx=tx, wrt=nnx.Param), None


def _multisteps():
    model = _cookbook_sequential(nnx.Rngs(0))
    tx = optax.MultiSteps(optax.adam(LR), every_k_schedule=2)
    return model, nnx.Optimizer(model, tx=tx, wrt=nnx.Param), None


def _lbfgs():
    model = _cookbook_sequential(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.lbfgs(LR), wrt=nnx.Param), None


def _lbfgs_step(model, optimizer, extra, x, y, reduce: Reduce):
    """The cookbook's LBFGS step; the loss and the line search's value_fn are of the global
    batch: all-reduced under mirrored (the error of item 6 names this fix)."""
    replicated = reduce is not jnp.mean
    total = mirrored.get_replica_context().all_reduce if replicated else None

    def global_loss(m):
        loss = _sum_of_squares(m, x, y, reduce)
        return total("SUM", loss) if total else loss

    graphdef = nnx.graphdef(model)
    loss_fn_state = lambda state: global_loss(nnx.merge(graphdef, state))  # noqa: E731
    loss, grads = nnx.value_and_grad(lambda m: _sum_of_squares(m, x, y, reduce))(model)
    loss = total("SUM", loss) if total else loss
    optimizer.update(model, grads, grad=grads, value=loss, value_fn=loss_fn_state)
    return loss


# --- transforms ------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.norm(self.linear(x)))


class ScannedStack(nnx.Module):
    """The transforms guide's scan over layers: blocks made by a vmapped constructor, run by
    nnx.scan; optionally each block under nnx.remat."""

    def __init__(self, rngs: nnx.Rngs, remat: bool = False):
        self.inp = nnx.Linear(6, 8, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return Block(rngs)

        self.blocks = create_block(rngs)
        self.remat = remat
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        def forward(x, block):
            return nnx.remat(Block.__call__)(block, x) if self.remat else block(x)

        x = nnx.scan(forward, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(self.inp(x), self.blocks)
        return self.out(x)


class Ensemble(nnx.Module):
    """The transforms guide's vmapped ensemble: 3 members, one input, outputs averaged."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs):
            return Mlp(rngs)

        self.members = create(rngs)

    def __call__(self, x):
        outputs = nnx.vmap(lambda m, x: m(x), in_axes=(0, None), out_axes=0)(self.members, x)
        return outputs.mean(0)


class Gated(nnx.Module):
    """nnx.cond choosing a branch from state (a step counter held in a Variable)."""

    def __init__(self, rngs: nnx.Rngs):
        self.mlp = Mlp(rngs)
        self.skip = nnx.Linear(6, 4, rngs=rngs)
        self.calls = nnx.Variable(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.calls[...] += 1
        return nnx.cond(
            self.calls[...] % 2 == 0, lambda m, x: m.mlp(x), lambda m, x: m.skip(x), self, x
        )


def _with_sgd(
    make: Callable[[nnx.Rngs], nnx.Module], tx: Callable[[], Any] = lambda: optax.sgd(0.1)
):
    def build():
        model = make(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx(), wrt=nnx.Param), None

    return build


# --- filters, surgery, the bridge, pytrees ---------------------------------------------------


class Scale(nnx.Param):
    """A user's own parameter kind (the filters guide): a subclass of nnx.Param."""


class Scaled(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mlp = Mlp(rngs)
        self.scale = Scale(jnp.full((4,), 0.5))

    def __call__(self, x):
        return self.mlp(x) * self.scale[...]


def _only_out_layer():
    model = Mlp(nnx.Rngs(0))
    wrt = nnx.All(nnx.Param, nnx.PathContains("out"))
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=wrt), None


def _only_out_layer_step(model, optimizer, extra, x, y, reduce: Reduce):
    wrt = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("out")))
    loss, grads = nnx.value_and_grad(lambda m: reduce(_squared_error(m, x, y)), argnums=wrt)(model)
    optimizer.update(model, grads)
    return loss


def _surgery():
    """The surgery guide: a layer swapped for a new one, pretrained NumPy weights loaded into
    part of the model with nnx.update, then trained."""
    model = Mlp(nnx.Rngs(0))
    model.hidden = nnx.Linear(6, 8, use_bias=False, rngs=nnx.Rngs(1))
    pretrained = np.linspace(-0.5, 0.5, 32, dtype=np.float32).reshape(8, 4)
    nnx.update(model.out, {"kernel": pretrained, "bias": np.zeros(4, np.float32)})
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), None


class LinenInside(nnx.Module):
    """The bridge guide: a Linen Dense (and a Linen MLP) inside an NNX module, lazily built."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.bridge.ToNNX(nn.Dense(8), rngs=rngs)
        self.dense.lazy_init(jnp.ones((1, 6)))
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.dense(x)))


class Layers(nnx.Module):
    """The pytree guide: layers in an nnx.List, weights shared by reference."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(6, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)])
        self.layers.append(self.layers[1])  # the same module twice: tied weights
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.out(x)


# --- views, intermediates, normalisation, attention -----------------------------------------


class WithDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mlp = Mlp(rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.mlp(x))


def _view_step(model, optimizer, extra, x, y, reduce: Reduce):
    """The view guide: a deterministic view of the model trained (dropout off)."""
    view = nnx.view(model, deterministic=True)
    return _default_step(view, optimizer, extra, x, y, reduce)


class Sowing(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mlp = Mlp(rngs)

    def __call__(self, x):
        h = jnp.tanh(self.mlp.hidden(x))
        self.sow(nnx.Intermediate, "hidden", h)
        return self.mlp.out(h)


def _intermediates_step(model, optimizer, extra, x, y, reduce: Reduce):
    """The intermediates guide: sown activations captured (nnx.capture) and used in the loss
    (an activation penalty per example)."""

    def loss_fn(model):
        prediction, intermediates = nnx.capture(model, nnx.Intermediate)(x)
        (hidden,) = jax.tree.leaves(intermediates)
        error = jnp.mean((prediction - y) ** 2, axis=-1)
        return reduce(error + 1e-2 * jnp.sum(hidden**2, axis=-1))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


class Normed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, norm: type = nnx.BatchNorm):
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.norm = norm(8, rngs=rngs)
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.hidden(x))))


class Attention(nnx.Module):
    """Gemma's building blocks, small: RMSNorm and causal multi-head self-attention over the 6
    features read as a sequence of 3 tokens of 2."""

    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(2, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=2, in_features=2, qkv_features=4, decode=False, rngs=rngs
        )
        self.out = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x):
        tokens = x.reshape(x.shape[0], 3, 2)
        mask = nnx.make_causal_mask(tokens[..., 0])
        tokens = tokens + self.attention(self.norm(tokens), mask=mask)
        return self.out(tokens.reshape(x.shape[0], 6))


class Counting(nnx.Module):
    """A user's own Variable kind holding a counter (the pytree guide's state)."""

    def __init__(self, rngs: nnx.Rngs):
        self.mlp = Mlp(rngs)
        self.count = Counter(jnp.array(0, jnp.int32))

    def __call__(self, x):
        self.count[...] += 1
        return self.mlp(x)


class Counter(nnx.Variable):
    pass


# --- training techniques ---------------------------------------------------------------------


def _transfer_learning():
    """The transfer-learning guide: a frozen backbone (set_to_zero) and a trained head."""
    model = Mlp(nnx.Rngs(0))
    labels = nnx.map_state(
        lambda path, v: "frozen" if "hidden" in path else "trainable", nnx.state(model, nnx.Param)
    )
    tx = optax.multi_transform({"trainable": optax.adam(LR), "frozen": optax.set_to_zero()}, labels)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param), None


def _scheduled():
    """The lr-schedule guide: warmup then cosine decay, the step counter read in the step."""
    model = Mlp(nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)
    return model, nnx.Optimizer(model, optax.sgd(schedule, momentum=0.9), wrt=nnx.Param), None


def _scheduled_step(model, optimizer, extra, x, y, reduce: Reduce):
    loss = _default_step(model, optimizer, extra, x, y, reduce)
    return loss, optimizer.step[...]


@functools.cache
def _checkpoint_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="mirrored-flax-guides-")


def _restored_from_orbax():
    """The checkpointing guide: an abstract model (nnx.eval_shape), its state restored with
    Orbax's StandardCheckpointer from a checkpoint of plain Flax, merged, then trained."""
    path = f"{_checkpoint_dir()}/pretrained"
    checkpointer = ocp.StandardCheckpointer()
    import os

    if not os.path.exists(path):
        source = Mlp(nnx.Rngs(42))
        checkpointer.save(path, nnx.state(source))
        checkpointer.wait_until_finished()
    abstract = nnx.eval_shape(lambda: Mlp(nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    model = nnx.merge(graphdef, checkpointer.restore(path, abstract_state))
    return model, nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param), None


RECIPES: dict[str, Recipe] = {
    # The optimization cookbook (docs_nnx/guides/optimization_cookbook).
    "cookbook/ema": Recipe(_ema, _ema_step),
    "cookbook/lora": Recipe(_lora, _lora_step),
    "cookbook/lbfgs": Recipe(_lbfgs, _lbfgs_step),
    "cookbook/per_parameter_rates": Recipe(_per_parameter_rates, _sum_of_squares_step),
    "cookbook/multisteps": Recipe(_multisteps, _sum_of_squares_step),
    # Transforms.
    "transforms/scan_over_layers": Recipe(_with_sgd(ScannedStack)),
    "transforms/scan_remat": Recipe(_with_sgd(functools.partial(ScannedStack, remat=True))),
    "transforms/vmap_ensemble": Recipe(_with_sgd(Ensemble)),
    "transforms/cond_on_state": Recipe(_with_sgd(Gated)),
    # Filters, surgery, the bridge, pytrees.
    "filters/own_param_kind": Recipe(_with_sgd(Scaled)),
    "filters/diff_state": Recipe(_only_out_layer, _only_out_layer_step),
    "surgery/swap_and_load": Recipe(_surgery),
    "bridge/linen_dense": Recipe(_with_sgd(LinenInside, lambda: optax.adam(LR))),
    "pytree/list_and_tied": Recipe(_with_sgd(Layers)),
    "pytree/own_variable_counter": Recipe(_with_sgd(Counting)),
    # Views, intermediates, normalisation, attention, dtypes.
    "view/deterministic": Recipe(_with_sgd(WithDropout), _view_step),
    "intermediates/sow_and_pop": Recipe(_with_sgd(Sowing), _intermediates_step),
    "batch_norm/sync": Recipe(_with_sgd(functools.partial(Normed, norm=SyncBatchNorm))),
    "batch_norm/plain": Recipe(_with_sgd(Normed)),
    "layer_norm": Recipe(_with_sgd(functools.partial(Normed, norm=nnx.LayerNorm))),
    # SGD: the keys' bias has a gradient of exactly 0 (softmax ignores a shift shared by all
    # keys), whose float noise Adam would scale to full steps of random sign, one device too.
    "gemma/attention": Recipe(_with_sgd(Attention)),
    "dtypes/bfloat16_compute": Recipe(
        _with_sgd(functools.partial(Mlp, dtype=jnp.bfloat16)), tolerance=1e-2
    ),
    # Training techniques.
    "techniques/transfer_learning": Recipe(_transfer_learning),
    "techniques/lr_schedule": Recipe(_scheduled, _scheduled_step),
    "checkpointing/orbax_restore": Recipe(_restored_from_orbax),
}
# Recipes whose numbers are not one device's, by design (the reason; documented).
CANNOT_MATCH = {
    # TensorFlow's rule: a plain BatchNorm normalises each replica's rows (SyncBatchNorm for
    # one device's numbers; mirrored warns below ~32 rows per replica).
    "batch_norm/plain": "per-replica batch statistics",
}


def _state(*trees) -> list[np.ndarray]:
    leaves = []
    for tree in trees:
        if tree is None:
            continue
        for _, leaf in nnx.to_flat_state(nnx.state(tree)):
            value = leaf.get_value() if hasattr(leaf, "get_value") else leaf
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                continue  # random keys: per replica by design
            leaves.append(np.asarray(value).astype(np.float64))
    return leaves


def _plain(recipe: Recipe):
    model, optimizer, extra = recipe.build()
    step = nnx.jit(functools.partial(recipe.step, reduce=jnp.mean))
    outputs = [step(model, optimizer, extra, x, y) for x, y in BATCHES]
    return _state(model, optimizer, extra), outputs


@pytest.fixture(scope="module")
def strategy():
    return mirrored.MirroredStrategy(jax.devices())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_flax_guide_recipe_on_8_replicas_equals_one_device(strategy, name):
    recipe = RECIPES[name]
    expected, _ = _plain(recipe)
    with strategy.scope():
        model, optimizer, extra = recipe.build()
    step = functools.partial(recipe.step, reduce=mirrored.compute_average_loss)
    for x, y in strategy.experimental_distribute_dataset(BATCHES):
        strategy.run(step, args=(model, optimizer, extra, x, y))
    got = _state(model, optimizer, extra)
    assert len(got) == len(expected) and got, name
    differences = [float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True)]
    scale = max(float(np.max(np.abs(b))) for b in expected)
    matched = max(differences) <= recipe.tolerance * max(scale, 1.0)
    assert matched != (name in CANNOT_MATCH), (name, max(differences))
