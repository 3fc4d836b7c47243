"""Plain Keras, in a process where mirrored is never imported: test_keras' references.

    python _keras_reference.py OUT.json                  every reference test_keras compares with
    python _keras_reference.py OUT.json --with-mirrored  `import mirrored, mirrored.keras` first,
                                                         then only the "outside" results
    python _keras_reference.py OUT.json --objectives     only the losses and metrics of
                                                         test_objectives (whole batch, per token)

mirrored.keras patches Keras process-wide (losses, BatchNormalization, optimizers, the
recurrent loop, the trainer), so a reference computed in the test's own process shares those
patches and any bug in them. Floats go through JSON exactly (float32 -> double -> text).
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
WITH_MIRRORED = "--with-mirrored" in sys.argv[2:]
if WITH_MIRRORED:
    import mirrored
    import mirrored.keras

import jax  # noqa: E402

if os.environ.get("MIRRORED_COMPILATION_CACHE"):
    # The suite's cache (conftest), read only: a program the tests compiled is read back, so
    # the two processes' results can only differ where their programs do. No writes: without
    # mirrored, each of JAX's writes to a bounded cache scans the whole directory (1.5 s per
    # program at 10,000 entries; mirrored's own setting scans only when it may be full).
    jax.config.update("jax_compilation_cache_dir", os.environ["MIRRORED_COMPILATION_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    jax.config.update("jax_compilation_cache_max_size", 4 * 2**30)  # locked reads

import keras  # noqa: E402
import numpy as np  # noqa: E402

import _keras_models as m  # noqa: E402

EVALUATE = {"batch_size": 64, "verbose": 0}


def plain(value):
    """`value` as JSON data: arrays and NumPy scalars become (nested) lists and floats."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray | np.generic) or hasattr(value, "__array__"):
        return np.asarray(value).tolist()
    return value


def fitted(model, x, y, **options):
    history = model.fit(x, y, **{**m.FIT, "epochs": 2, **options}).history
    return {"weights": model.get_weights(), "history": history}


def fit_evaluate_predict():
    model = m.compiled()
    out = fitted(model, m.X, m.Y)
    out["evaluate"] = model.evaluate(m.X, m.Y, **EVALUATE)
    out["predict"] = model.predict(m.X, **EVALUATE)
    return out


def penalized():
    model = m.penalized()
    return {**fitted(model, m.X, m.Y), "evaluate": model.evaluate(m.X, m.Y, **EVALUATE)}


def recurrent(kind):
    model, labels = m.recurrent(kind)
    m.compile_loss_only(model)
    return {
        **fitted(model, m.TOKENS, labels),
        "evaluate": model.evaluate(m.TOKENS, labels, verbose=0),
    }


def two_outputs():
    model = m.two_outputs()
    out = fitted(model, m.X, m.TWO_OUTPUT_LABELS)
    out["evaluate"] = model.evaluate(m.X, m.TWO_OUTPUT_LABELS, **EVALUATE, return_dict=True)
    return out


def train_on_batch():
    model = m.compile_loss_only(m.sequential(input_shape=False))
    losses = [model.train_on_batch(x, y) for x, y in m.BATCHES[-5:]]  # ends ragged (13)
    return {"losses": losses, "weights": model.get_weights()}


def sum_reduction():
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    x, y = m.BATCHES[-1]
    return loss_fn(y, m.sequential(input_shape=False)(x))


def adam():
    """Three epochs of Adam, and the weights after the second."""
    model = m.adam_model()
    after = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: after.append(model.get_weights())
    )
    out = fitted(model, m.X, m.Y, epochs=3, callbacks=[record])
    return {**out, "weights_after_2": after[1]}


def outside():
    """What mirrored's patches must leave exactly as it is outside every strategy."""
    model = m.everyday()
    # 256 rows to train on and 128 to validate: full batches, one program each.
    x, y, weights = m.X[:384], m.Y[:384], m.SAMPLE_WEIGHTS[:384]
    out = fitted(model, x, y, sample_weight=weights, validation_split=1 / 3)
    out["train_on_batch"] = model.train_on_batch(*m.BATCHES[-1], return_dict=True)
    out["test_on_batch"] = model.test_on_batch(*m.BATCHES[0], return_dict=True)
    out["evaluate"] = model.evaluate(m.X, m.Y, **EVALUATE, return_dict=True)
    out["predict"] = model.predict(m.X[:100], **EVALUATE)
    out["predict_on_batch"] = model.predict_on_batch(m.X[:13])
    x, y = m.BATCHES[-1]
    out["training_call"] = model(x, training=True)  # BatchNormalization's moments, Dropout
    out["moving_statistics"] = model.layers[1].get_weights()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    out["loss_call"] = [loss(y, model(x)), loss(y, model(x), sample_weight=m.SAMPLE_WEIGHTS[:13])]
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    grads = [np.full(v.shape, 0.01, "float32") for v in model.trainable_variables]
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    out["after_apply_gradients"] = model.get_weights()
    rnn = m.everyday_recurrent()
    out["recurrent"] = fitted(rnn, m.TOKENS[:128], m.Y[:128], epochs=1)
    out["recurrent"]["predict"] = rnn.predict(m.TOKENS[:64], verbose=0)
    return out


def whole_batch():
    """Losses and metrics of the whole batch: fit (sample weights, a ragged last batch of 13),
    then evaluate."""
    out = {}
    for loss in m.WHOLE_BATCH_LOSSES:
        model = m.whole_batch(loss)
        fit = fitted(model, m.X, m.BINARY, sample_weight=m.SAMPLE_WEIGHTS)
        fit["evaluate"] = model.evaluate(m.X, m.BINARY, **EVALUATE, return_dict=True)
        out[loss] = fit
    return out


def per_token():
    """Per-token weights `(n, T)` and a Keras mask: fit, then evaluate with and without the
    weights, at each batch size of PER_TOKEN_BATCHES."""
    out = {}
    labels = m.TOKENS % 3
    for batch in m.PER_TOKEN_BATCHES:
        model = m.per_token()
        options = {"batch_size": batch, "verbose": 0}
        out[str(batch)] = {
            "evaluate": model.evaluate(m.TOKENS, labels, **options, return_dict=True),
            **fitted(model, m.TOKENS, labels, sample_weight=m.TOKEN_WEIGHTS, batch_size=batch),
            "weighted": model.evaluate(
                m.TOKENS, labels, sample_weight=m.TOKEN_WEIGHTS, **options, return_dict=True
            ),
        }
    return out


def hunt():
    """Every Keras loss (called on a ragged batch of 37, with and without sample weights) and
    every metric (compiled by string and by object; evaluate at batch 16: 16, 16 and 5)."""
    out = {"losses": {}, "metrics": {}, "updated": {}}
    for family, (labels, predictions, _, _) in m.HUNT_DATA.items():
        for name in m.HUNT_LOSSES[family] + m.HUNT_LOSS_STRINGS[family]:
            loss = m.hunt_loss(name)
            out["losses"][f"{family}/{name}"] = [
                loss(labels, predictions),
                loss(labels, predictions, sample_weight=m.HUNT_WEIGHTS),
            ]
        for kind in ("objects", "strings"):
            model = m.hunt_compiled(family, kind)
            out["metrics"][f"{family}/{kind}"] = model.evaluate(
                m.HUNT_X, labels, batch_size=16, verbose=0, return_dict=True
            )
        for name, options in m.HUNT_METRICS[family]:  # on the predictions, batches of 16
            out["updated"][f"{family}/{name}"] = [
                updated(getattr(keras.metrics, name)(**options), labels, predictions, weights)
                for weights in (None, m.HUNT_WEIGHTS)
            ]
    return out


def updated(metric, labels, predictions, weights):
    """A metric's result after updates with batches of 16 (16, 16 and 5 rows)."""
    for start in range(0, len(labels), 16):
        rows = slice(start, start + 16)
        metric.update_state(
            labels[rows], predictions[rows], None if weights is None else weights[rows]
        )
    return metric.result()


def references():
    return {
        "fit": fit_evaluate_predict(),
        "penalized": penalized(),
        "recurrent": recurrent("recurrent"),
        "per_token": recurrent("per_token"),
        "two_outputs": two_outputs(),
        "sample_weights": fitted(m.compiled(), m.X, m.Y, sample_weight=m.SAMPLE_WEIGHTS),
        "halve_at_batch_3": fitted(m.compiled(), m.X, m.Y, callbacks=[m.HalveAtBatch3()]),
        "train_on_batch": train_on_batch(),
        "sum_reduction": sum_reduction(),
        "batch_norm": fitted(m.compiled(norm="plain"), m.X, m.Y, epochs=1),
        "adam": adam(),
        "outside": outside(),
    }


def main():
    if "--objectives" in sys.argv[2:]:
        results = {"whole_batch": whole_batch(), "per_token": per_token(), "hunt": hunt()}
    elif WITH_MIRRORED:
        results = {"outside": outside()}
    else:
        results = references()
    results["mirrored_imported"] = "mirrored" in sys.modules
    results["patched"] = "mirrored.keras" in sys.modules
    if WITH_MIRRORED:
        results["mirrored_file"] = mirrored.__file__
    with open(sys.argv[1], "w") as f:
        json.dump(plain(results), f)


if __name__ == "__main__":
    main()
