"""The Keras data and models of test_keras, shared with _keras_reference.py: no mirrored here,
so that the plain Keras references can be computed in a process that never imports it."""

import keras
import numpy as np

RNG = np.random.default_rng(0)
X = RNG.normal(size=(525, 20)).astype("float32")  # 525 at batch 64: the last batch has 13
Y = RNG.integers(0, 10, 525).astype("int32")
BATCHES = [(X[i : i + 64], Y[i : i + 64]) for i in range(0, 525, 64)]
SAMPLE_WEIGHTS = np.linspace(0.2, 2.0, 525).astype("float32")
TOKENS = RNG.integers(1, 50, size=(525, 7)).astype("int32")
TOKENS[::3, 4:] = 0  # padding tokens: masked by Embedding(mask_zero=True)
TWO_OUTPUT_LABELS = {"cls": Y, "reg": X[:, :1] * 2.0}
FIT = {"batch_size": 64, "shuffle": False, "verbose": 0}


def sequential(*, dropout=0.0, norm=None, input_shape=True):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((20,))] if input_shape else []
    layers.append(keras.layers.Dense(32, activation="relu"))
    if norm is not None:
        layers.append(keras.layers.BatchNormalization(momentum=0.8, synchronized=norm == "sync"))
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def compile_sgd(model, **options):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **options,
    )
    return model


def compiled(**kwargs):
    return compile_sgd(sequential(**kwargs))


class PenalizedLoss(keras.Model):
    """Keras' guide pattern: `compute_loss` overridden to scale the loss and add a penalty."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        base = super().compute_loss(x, y, y_pred, sample_weight, training)
        kernel = self.layers[-1].kernel
        return 3.0 * base + 0.01 * keras.ops.sum(keras.ops.square(kernel)) + 0.5


def penalized():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(32, activation="relu", kernel_regularizer="l2")(inputs)
    return compile_sgd(PenalizedLoss(inputs, keras.layers.Dense(10)(hidden)))


def recurrent(kind):
    """(model, labels): embedded tokens through recurrent layers, or a per-token loss."""
    keras.utils.set_random_seed(3)
    tokens = keras.Input((7,), dtype="int32")
    embedded = keras.layers.Embedding(50, 8, mask_zero=True)(tokens)
    if kind == "per_token":  # the mask reaches the loss: a mean over the real tokens
        return keras.Model(tokens, keras.layers.Dense(3)(embedded)), TOKENS % 3
    sequence = keras.layers.Bidirectional(keras.layers.LSTM(4, return_sequences=True))(embedded)
    hidden = keras.layers.GRU(4, go_backwards=True)(sequence)
    return keras.Model(tokens, keras.layers.Dense(10)(hidden)), Y


def compile_loss_only(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def two_outputs():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(
        32,
        activation="relu",
        kernel_regularizer=keras.regularizers.L2(0.05),
        activity_regularizer=keras.regularizers.L1(0.01),
    )(inputs)
    outputs = {
        "cls": keras.layers.Dense(10, name="cls")(hidden),
        "reg": keras.layers.Dense(1, name="reg")(hidden),
    }
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )
    return model


def adam_model():
    model = sequential()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


class HalveAtBatch3(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:  # `self.model` brings Keras' per-step state back into the variables
            self.model.set_weights([w * 0.5 for w in self.model.get_weights()])


def everyday():
    """A model with every Keras part mirrored patches (outside a strategy they must change
    nothing): regularizers, BatchNormalization, seeded Dropout, Adam."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(
                16,
                activation="relu",
                kernel_regularizer=keras.regularizers.L2(0.01),
                activity_regularizer=keras.regularizers.L1(0.001),
            ),
            keras.layers.BatchNormalization(momentum=0.8),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def everyday_recurrent():
    keras.utils.set_random_seed(6)
    tokens = keras.Input((7,), dtype="int32")
    embedded = keras.layers.Embedding(50, 8, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(10)(keras.layers.GRU(4)(embedded)))
    return compile_loss_only(model)


# -- losses and metrics of the whole batch (not a mean of per-example terms) -------------------

BINARY = (X[:, :3] + 0.3 * X[:, 3:6] > 0).astype("float32")  # 3 labels per row, 0/1


def rmse(y_true, y_pred):
    """The classic compiled metric: one number per batch."""
    return keras.ops.sqrt(keras.ops.mean(keras.ops.square(y_true - y_pred)))


def mean_squared_scalar(y_true, y_pred):
    """A user's loss function that reduces the batch itself (`ops.mean`)."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


class ReducingLoss(keras.losses.Loss):
    """A user's `Loss` subclass whose `call` reduces: squared error over the batch's sum."""

    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred)) / (
            keras.ops.sum(y_true) + keras.ops.sum(y_pred) + 1.0
        )


def whole_batch(loss):
    """A sigmoid model on BINARY, compiled with `loss` and the scalar `rmse` metric."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, activation="sigmoid"),
        ]
    )
    losses = {
        "dice": keras.losses.Dice(),
        "tversky": keras.losses.Tversky(alpha=0.3, beta=0.7),
        "scalar_function": mean_squared_scalar,
        "reducing_subclass": ReducingLoss(),
    }
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=losses[loss],
        metrics=[rmse, "binary_accuracy"],
        weighted_metrics=["mse"],  # rmse here: Keras broadcasts its one number to the weights
    )
    return model


WHOLE_BATCH_LOSSES = ("dice", "tversky", "scalar_function", "reducing_subclass")


# -- per-token sample weights and Keras masks -----------------------------------------------

TOKEN_WEIGHTS = RNG.uniform(0.2, 2.0, size=TOKENS.shape).astype("float32")


def per_token():
    """Embedded tokens (`mask_zero=True`) to a per-token 3-way classifier, with metrics and
    weighted metrics: the Keras mask and `(n, T)` weights reach both."""
    keras.utils.set_random_seed(3)
    tokens = keras.Input((7,), dtype="int32")
    embedded = keras.layers.Embedding(50, 8, mask_zero=True)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(3)(embedded))
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=["accuracy", "sparse_categorical_crossentropy"],
    )
    return model


PER_TOKEN_BATCHES = (32, 40)  # 4 and 5 rows per replica at 8 replicas


# -- every Keras loss and metric (issue 33, item 12) -------------------------------------------

HUNT_ROWS = 37  # at batch 16: 16, 16 and a ragged 5; a ragged global batch of 37 for losses
_HUNT = np.random.default_rng(12)
HUNT_X = _HUNT.normal(size=(HUNT_ROWS, 6)).astype("float32")
HUNT_WEIGHTS = _HUNT.uniform(0.2, 2.0, HUNT_ROWS).astype("float32")
_CLASSES = _HUNT.integers(0, 5, HUNT_ROWS)
HUNT_DATA = {  # family: (labels, predictions as a model's outputs, output units, activation)
    "regression": (
        _HUNT.uniform(0.5, 2.0, (HUNT_ROWS, 3)).astype("float32"),
        _HUNT.uniform(0.1, 2.5, (HUNT_ROWS, 3)).astype("float32"),
        3,
        "softplus",
    ),
    "binary": (
        (_HUNT.random((HUNT_ROWS, 1)) < 0.4).astype("float32"),
        _HUNT.uniform(0.01, 0.99, (HUNT_ROWS, 1)).astype("float32"),
        1,
        "sigmoid",
    ),
    "categorical": (
        np.eye(5, dtype="float32")[_CLASSES],
        _HUNT.dirichlet(np.ones(5), HUNT_ROWS).astype("float32"),
        5,
        "softmax",
    ),
    "sparse": (
        _CLASSES.astype("int32"),
        _HUNT.dirichlet(np.ones(5), HUNT_ROWS).astype("float32"),
        5,
        "softmax",
    ),
}
# Every class in keras.losses and keras.metrics, by the data it scores; what is left out, why.
HUNT_LOSSES = {
    "regression": [
        "CosineSimilarity", "Huber", "LogCosh", "MeanAbsoluteError",
        "MeanAbsolutePercentageError", "MeanSquaredError", "MeanSquaredLogarithmicError",
        "Poisson", "Dice", "Tversky",
    ],
    "binary": ["BinaryCrossentropy", "BinaryFocalCrossentropy", "Hinge", "SquaredHinge"],
    "categorical": [
        "CategoricalCrossentropy", "CategoricalFocalCrossentropy", "CategoricalHinge",
        "KLDivergence",
    ],
    # CategoricalGeneralizedCrossEntropy takes integer labels, despite its name.
    "sparse": ["SparseCategoricalCrossentropy", "CategoricalGeneralizedCrossEntropy", "Circle"],
}  # fmt: skip
HUNT_LOSS_STRINGS = {
    "regression": [
        "mse", "mae", "mape", "msle", "huber", "log_cosh", "poisson", "cosine_similarity",
    ],
    "binary": ["binary_crossentropy", "binary_focal_crossentropy", "hinge", "squared_hinge"],
    "categorical": ["categorical_crossentropy", "categorical_hinge", "kl_divergence"],
    "sparse": ["sparse_categorical_crossentropy"],
}  # fmt: skip
HUNT_METRICS = {
    "regression": [
        ("CosineSimilarity", {}), ("LogCoshError", {}), ("MeanAbsoluteError", {}),
        ("MeanAbsolutePercentageError", {}), ("MeanSquaredError", {}),
        ("MeanSquaredLogarithmicError", {}), ("R2Score", {}), ("RootMeanSquaredError", {}),
        ("ConcordanceCorrelation", {}), ("PearsonCorrelation", {}), ("Poisson", {}),
    ],
    "binary": [
        ("Accuracy", {}), ("BinaryAccuracy", {}), ("AUC", {}), ("FalseNegatives", {}),
        ("FalsePositives", {}), ("Precision", {}), ("PrecisionAtRecall", {"recall": 0.5}),
        ("Recall", {}), ("RecallAtPrecision", {"precision": 0.5}),
        ("SensitivityAtSpecificity", {"specificity": 0.5}),
        ("SpecificityAtSensitivity", {"sensitivity": 0.5}), ("TrueNegatives", {}),
        ("TruePositives", {}), ("BinaryIoU", {}), ("BinaryCrossentropy", {}), ("Hinge", {}),
        ("SquaredHinge", {}),
    ],
    "categorical": [
        ("CategoricalAccuracy", {}), ("TopKCategoricalAccuracy", {"k": 2}), ("F1Score", {}),
        ("FBetaScore", {"beta": 2.0}),
        ("OneHotIoU", {"num_classes": 5, "target_class_ids": [0, 1]}),
        ("OneHotMeanIoU", {"num_classes": 5}), ("CategoricalHinge", {}), ("KLDivergence", {}),
        ("CategoricalCrossentropy", {}),
    ],
    "sparse": [
        ("SparseCategoricalAccuracy", {}), ("SparseTopKCategoricalAccuracy", {"k": 2}),
        ("SparseCategoricalCrossentropy", {}),
        ("MeanIoU", {"num_classes": 5, "sparse_y_pred": False}),
        ("IoU", {"num_classes": 5, "target_class_ids": [0, 1], "sparse_y_pred": False}),
    ],
}  # fmt: skip
HUNT_METRIC_STRINGS = {
    "regression": ["mse", "mae", "mape", "msle", "cosine_similarity", "log_cosh_error", "poisson"],
    "binary": ["accuracy", "binary_accuracy", "binary_crossentropy", "hinge", "squared_hinge"],
    "categorical": [
        "accuracy", "categorical_accuracy", "top_k_categorical_accuracy",
        "categorical_crossentropy", "kl_divergence",
    ],
    "sparse": [
        "accuracy", "sparse_categorical_accuracy", "sparse_top_k_categorical_accuracy",
        "sparse_categorical_crossentropy",
    ],
}  # fmt: skip
HUNT_LEFT_OUT = {
    "CTC": "a sequence loss with label and logit lengths: tested on its own, not in a family",
    "Mean": "a container of values, not a compiled (y_true, y_pred) metric",
    "Sum": "a container of values, not a compiled (y_true, y_pred) metric",
    "MeanMetricWrapper": "the wrapper of every string and function metric above",
}


def hunt_model(family):
    """One Dense layer from HUNT_X to the family's outputs (fixed seed)."""
    _, _, units, activation = HUNT_DATA[family]
    keras.utils.set_random_seed(12)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(units, activation=activation)])


def hunt_metrics(family, kind):
    if kind == "strings":
        return list(HUNT_METRIC_STRINGS[family])
    return [getattr(keras.metrics, name)(**options) for name, options in HUNT_METRICS[family]]


def hunt_compiled(family, kind):
    model = hunt_model(family)
    loss = {"regression": "mse", "binary": "binary_crossentropy"}.get(family)
    loss = loss or ("categorical_crossentropy" if family == "categorical" else
                    "sparse_categorical_crossentropy")  # fmt: skip
    model.compile(optimizer="sgd", loss=loss, metrics=hunt_metrics(family, kind))
    return model


def hunt_loss(name):
    """A loss object by class name, or Keras' compile-time wrapper of a loss by string."""
    if hasattr(keras.losses, name) and isinstance(getattr(keras.losses, name), type):
        return getattr(keras.losses, name)()
    from keras.src.losses.losses import LossFunctionWrapper

    return LossFunctionWrapper(keras.losses.get(name), name=name)
