"""A small decoder-only transformer language model with mirrored.MirroredStrategy — copy this file.

Character level, trained on Python's own reference documentation (the text `help("assert")`
shows, in the standard library's `pydoc_data`), so nothing is downloaded. Prints the held-out
loss (nats per character, dropout off) against the unigram baseline: the loss of the best model
that ignores context.

    python examples/transformer_lm.py [--steps 300] [--devices 8]
    mirrored doctor --devices 8 --step examples/transformer_lm.py:doctor_step
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mirrored

GLOBAL_BATCH_SIZE = 64
SEQ_LEN = 32
EVAL_BATCH_SIZE = 256


class Block(nnx.Module):
    """Pre-LayerNorm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, num_heads: int, dropout: float, *, rngs: nnx.Rngs) -> None:
        self.attention_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads, d_model, dropout_rate=dropout, deterministic=False, decode=False, rngs=rngs
        )
        self.mlp_norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.mlp_in = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d_model, d_model, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attention(self.attention_norm(x), mask=mask))
        return x + self.dropout(self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x)))))


class TransformerLM(nnx.Module):
    """Token + learned position embeddings, causal blocks, a final norm, logits per position."""

    def __init__(
        self,
        vocab_size: int,
        *,
        seq_len: int = SEQ_LEN,
        d_model: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        dropout: float = 0.1,
        rngs: nnx.Rngs,
    ) -> None:
        self.token_embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
        self.position_embed = nnx.Embed(seq_len, d_model, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.blocks = nnx.List(
            [Block(d_model, num_heads, dropout, rngs=rngs) for _ in range(num_layers)]
        )
        self.norm = nnx.LayerNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = jnp.arange(tokens.shape[-1])
        x = self.dropout(self.token_embed(tokens) + self.position_embed(positions))
        mask = nnx.make_causal_mask(tokens)  # position t attends to positions ≤ t only
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def load_text() -> str:
    """Python's reference documentation as `help()` shows it (~465,000 characters in 3.11).

    It changes a little between Python versions; nothing here depends on its exact content.
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def char_dataset(text: str, held_out_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray, str]:
    """(train tokens, held-out tokens, vocabulary): the text's characters as ids, the last
    `held_out_fraction` of it held out."""
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    tokens = np.fromiter((lookup[c] for c in text), np.int32, count=len(text))
    cut = int(len(tokens) * (1 - held_out_fraction))
    return tokens[:cut], tokens[cut:], vocab


def random_windows(
    tokens: np.ndarray, *, steps: int, batch_size: int, seq_len: int = SEQ_LEN, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`steps` GLOBAL batches of windows at random offsets: inputs and the next characters."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch_size)
        rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        yield rows[:, :-1], rows[:, 1:]


def windows(tokens: np.ndarray, seq_len: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Every non-overlapping window of `tokens`: inputs and the next characters."""
    count = (len(tokens) - 1) // seq_len
    x = tokens[: count * seq_len].reshape(count, seq_len)
    y = tokens[1 : count * seq_len + 1].reshape(count, seq_len)
    return x, y


def unigram_entropy(tokens: np.ndarray) -> float:
    """Nats per character of the text's own character frequencies: no model that ignores the
    context scores below it on this text."""
    counts = np.bincount(tokens)
    p = counts[counts > 0] / len(tokens)
    return float(-np.sum(p * np.log(p)))


def make_optimizer(
    total_steps: int, *, peak_lr: float = 1e-2, weight_decay: float = 0.01
) -> optax.GradientTransformation:
    """Clip the global norm to 1, then AdamW on a warmup-cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=max(1, total_steps // 10),
        decay_steps=total_steps,
        end_value=peak_lr / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay)
    )


def per_sequence_loss(model: TransformerLM, x: jax.Array, y: jax.Array) -> jax.Array:
    """Each sequence's mean cross entropy per character, shape (batch,)."""
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean(axis=-1)


def train_step(model, optimizer, x, y):  # runs once per replica, on its shard of the batch
    def loss_fn(model):
        # Every sequence has SEQ_LEN characters, so the mean of the per-sequence means over
        # the GLOBAL batch is the mean per character.
        return mirrored.compute_average_loss(per_sequence_loss(model, x, y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)  # grads are summed over replicas
    optimizer.update(model, grads)
    return loss


def evaluate(strategy: mirrored.Strategy, model: TransformerLM, tokens: np.ndarray) -> float:
    """Mean cross entropy per character over every window of `tokens`, dropout off."""
    model.eval()  # Dropout and attention dropout become the identity
    try:
        dataset = strategy.experimental_distribute_dataset(
            windows(tokens, model.position_embed.num_embeddings), batch_size=EVAL_BATCH_SIZE
        )
        # run's per-example outputs carry the batch's mask: gather keeps the real rows only.
        losses = np.concatenate(
            [
                strategy.gather(strategy.run(per_sequence_loss, args=(model, x, y)), axis=0)
                for x, y in dataset
            ]
        )
    finally:
        model.train()
    return float(losses.mean())


def doctor_step():
    """For `mirrored doctor --step examples/transformer_lm.py:doctor_step`: one step to check."""
    train, _, vocab = char_dataset(load_text())
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = TransformerLM(len(vocab), rngs=nnx.Rngs(0))
        # Plain SGD: unlike Adam, it shows a wrongly scaled gradient in the update.
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    batch = next(iter(random_windows(train, steps=1, batch_size=GLOBAL_BATCH_SIZE)))
    (dist,) = list(strategy.experimental_distribute_dataset([batch]))
    return strategy, train_step, (model, optimizer, *dist)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=8, help="replicas (simulated on CPU)")
    args = parser.parse_args()
    # Here rather than at import: tests and benchmarks import this file after starting JAX.
    # Only affects the CPU backend, so harmless where GPUs are present.
    mirrored.simulate_cpu_devices(args.devices)

    train, held_out, vocab = char_dataset(load_text())
    baseline = unigram_entropy(held_out)
    print(f"text: {len(train):,} training and {len(held_out):,} held-out characters")

    strategy = mirrored.MirroredStrategy(jax.devices()[: args.devices])
    print(f"replicas: {strategy.num_replicas_in_sync}")
    with strategy.scope():  # state created here is mirrored on every device
        model = TransformerLM(len(vocab), rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_optimizer(args.steps), wrt=nnx.Param)
    params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {params:,} parameters, vocabulary {len(vocab)}")

    dataset = strategy.experimental_distribute_dataset(
        random_windows(train, steps=args.steps, batch_size=GLOBAL_BATCH_SIZE)
    )
    total, count = 0.0, 0
    for step, (x, y) in enumerate(dataset, start=1):
        per_replica_loss = strategy.run(train_step, args=(model, optimizer, x, y))
        total += strategy.reduce("SUM", per_replica_loss, axis=None)  # stays on the device
        count += 1
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: train loss {float(total) / count:.4f}")
            total, count = 0.0, 0

    loss = evaluate(strategy, model, held_out)
    print(
        f"held-out: {loss:.4f} nats/char vs unigram baseline {baseline:.4f} "
        f"({math.exp(loss):.2f} vs {math.exp(baseline):.2f} perplexity)"
    )
    print(f"final loss: {loss:.4f}")


if __name__ == "__main__":
    main()
