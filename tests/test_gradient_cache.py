"""Window-wide losses through gradient caching: exactly the large batch, or refused by name."""

import math

import numpy as np
import pytest
from keras import ops

import tfaccum
from reference import BACKEND
from reference import KERAS
from reference import compare
from reference import keras
from reference import max_diff
from reference import not_on_torch
from reference import mirrored

pytestmark = not_on_torch("window_loss")

# What only TensorFlow has here: tf.distribute, its stateful random ops, its
# loss-scaled window.
ON_TENSORFLOW = pytest.mark.backend(
    "tensorflow", reason="tf.distribute strategies (JAX's DataParallel: "
    "test_data_parallel_gathers_the_window_as_one_device)")

N, FEATURES = 38, 6


class LogScale(keras.layers.Layer):
    """A trainable log logit scale, as one more column per sample (CLIP's)."""

    def build(self, input_shape):
        self.log_scale = self.add_weight(
            name="log_scale", shape=(), initializer=keras.initializers.Constant(math.log(2.0)))

    def call(self, inputs):
        return ops.ones_like(inputs[:, :1]) * self.log_scale


def _tower(dropout=0.0, regularizer=None):
    layers = [keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer)]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    return keras.Sequential(layers + [keras.layers.Dense(4)])


def _optimizer(name):
    if name == "sgd_momentum":
        return keras.optimizers.SGD(0.5, momentum=0.9)
    if name == "sgd_ema":  # the weights `fit` ends with are the moving average's
        return keras.optimizers.SGD(0.5, momentum=0.9, use_ema=True, ema_momentum=0.5)
    if name == "adamw_bfloat16":
        # bfloat16 gradients keep about 3 digits: two right computations differ
        # by 1-2e-3, and Adam's first step turns a gradient within that noise
        # into a whole +-lr step (a sign flip: 0.047 where CPUs without
        # AVX-512 truncate bfloat16 matmuls). An epsilon at the noise's size
        # keeps such a step noise-sized.
        return keras.optimizers.AdamW(0.02, weight_decay=0.01, clipnorm=0.5, epsilon=1e-3)
    return keras.optimizers.AdamW(0.02, weight_decay=0.01, clipnorm=0.5)


def _custom(y_true, y_pred):
    """A user's own window loss: in-batch softmax over raw dot products, plus a target term.

    (The ranking term alone gives the document tower's last bias a zero
    gradient: AdamW would turn its rounding noise into full steps.)
    """
    q, d = ops.split(y_pred, 2, axis=-1)
    logits = ops.matmul(q, ops.transpose(d))
    ranking = ops.sparse_categorical_crossentropy(ops.arange(ops.shape(q)[0]), logits,
                                                  from_logits=True)
    return ranking + 0.1 * ops.sum(ops.square(q + d - ops.cast(y_true, q.dtype)), axis=-1)


LOSSES = {
    "in_batch": lambda: tfaccum.InBatchSoftmax(temperature=0.5),
    "clip": lambda: tfaccum.InBatchSoftmax(temperature="learned", symmetric=True),
    "raw": lambda: tfaccum.InBatchSoftmax(temperature=2.0, normalize=False),
    "nt_xent": lambda: tfaccum.NTXent(temperature=0.5),
    "custom": lambda: tfaccum.WindowLoss(_custom),
}


def build(loss="in_batch", optimizer="sgd_momentum", dropout=0.0, regularizer=None,
          **compile_kwargs):
    """Two towers (one shared encoder for NT-Xent's two views), outputs side by side."""
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    if loss == "nt_xent":
        encoder = _tower(dropout)
        towers = [encoder(first), encoder(second)]
    else:
        towers = [_tower(dropout, regularizer)(first), _tower(dropout)(second)]
    if loss == "clip":
        towers.append(LogScale()(first))
    model = keras.Model([first, second], keras.layers.Concatenate()(towers))
    # TensorFlow's XLA cannot hold a growing window; JAX compiles it as users do.
    compile_kwargs.setdefault("jit_compile", BACKEND != "tensorflow")
    model.compile(_optimizer(optimizer), loss=LOSSES[loss](), **compile_kwargs)
    return model


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = [rng.normal(size=(n, FEATURES)).astype("float32") for _ in range(2)]
    y = rng.normal(size=(n, 4)).astype("float32")
    return x, y


# A covering set: every loss, the optimizers (EMA too), every leftover policy, a
# short last micro-batch, sample weights and steps_per_execution each met once.
CASES = [
    dict(loss="in_batch", optimizer="sgd_momentum", leftover="flush", n=38, steps=3),
    dict(loss="clip", optimizer="adamw", leftover="carry", n=38, steps=3),
    dict(loss="nt_xent", optimizer="sgd_momentum", leftover="drop", n=40, steps=3),
    dict(loss="raw", optimizer="sgd_ema", leftover="flush", n=38, steps=3),
    dict(loss="custom", optimizer="adamw", leftover="flush", n=38, steps=4,
         sample_weight=True, steps_per_execution=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["loss"])
def test_a_window_of_micro_batches_is_the_large_batch(case):
    case = dict(case)
    n, steps, leftover = case.pop("n"), case.pop("steps"), case.pop("leftover")
    weights = case.pop("sample_weight", False)
    compile_kwargs = {}
    if "steps_per_execution" in case:
        compile_kwargs["steps_per_execution"] = case.pop("steps_per_execution")
    x, y = _data(n)
    sample_weight = np.linspace(0.5, 1.5, n).astype("float32") if weights else None
    result = compare(lambda: build(**case, **compile_kwargs), x, y, micro=4, steps=steps,
                     epochs=2, leftover=leftover, sample_weight=sample_weight)
    assert len(result.ours) == len(result.updates)
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build(**case)) > 1e-2
    callback = result.callback
    assert callback.optimizer_steps == len(result.updates)
    assert callback.micro_steps == 2 * math.ceil(n / 4)
    assert callback.samples == 2 * n
    if leftover == "drop":
        assert callback.dropped_micro_steps == 2
    if leftover == "flush":
        assert callback.flushes == 2


@pytest.mark.once
def test_a_one_sample_micro_batch_and_a_weightless_one_are_the_large_batch():
    """Degenerate windows: the last micro-batch holds one sample (its window of
    one has no negatives), and a whole micro-batch weighs 0 (its samples stay
    negatives for the others, as in the large batch)."""
    n = 37  # micro-batches of 4: the tenth holds one sample, flushed alone
    x, y = _data(n)
    sample_weight = np.ones(n, "float32")
    sample_weight[4:8] = 0.0
    result = compare(lambda: build("clip", "adamw"), x, y, micro=4, steps=3, epochs=2,
                     sample_weight=sample_weight)
    assert [len(update) for update in result.updates[:4]] == [12, 12, 12, 1]
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build("clip", "adamw")) > 1e-2
    assert all(np.isfinite(w).all() for w in result.model.get_weights())


@pytest.mark.once
def test_a_window_whose_sample_weights_are_all_zero_is_the_large_batch():
    """A whole window weighs 0 (its loss is 0; AdamW's decay still moves the weights)."""
    n = 24
    x, y = _data(n)
    sample_weight = np.ones(n, "float32")
    sample_weight[:12] = 0.0  # the first window of each epoch
    result = compare(lambda: build("in_batch", "adamw"), x, y, micro=4, steps=3, epochs=2,
                     sample_weight=sample_weight)
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build("in_batch", "adamw")) > 1e-2
    assert all(np.isfinite(w).all() for w in result.model.get_weights())


@pytest.mark.once
def test_nan_in_one_micro_batch_spoils_the_window_as_it_spoils_the_large_batch():
    """A NaN input in one micro-batch reaches every sample's loss through the
    in-batch negatives: the window's update is NaN where the large batch's is,
    and finite where it is finite (equal within 1e-5)."""
    n = 24
    x, y = _data(n)
    x[0][17, 2] = np.nan  # the second window's second micro-batch
    result = compare(lambda: build("in_batch", "sgd_momentum"), x, y, micro=4, steps=3)
    assert len(result.ours) == len(result.theirs) == 2
    for ours, theirs in zip(result.ours, result.theirs):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, equal_nan=True)
    assert np.isfinite(np.concatenate([w.ravel() for w in result.ours[0]])).all()
    assert not np.isfinite(np.concatenate([w.ravel() for w in result.ours[1]])).all()


def test_the_reported_loss_is_the_large_batch_loss():
    x, y = _data(36)
    model = build()
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3)])
    plain = build()
    reference = plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], reference.history["loss"], rtol=1e-5)
    assert history.history["loss"][0] != history.history["loss"][1]


def loss_and_gradients(model, forward):
    """`forward(model) -> loss` on the model's variables now, with its gradients
    (TensorFlow's tape, or `jax.grad` of the stateless forward pass)."""
    variables = model.trainable_variables
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = forward(model)
        return loss, tape.gradient(loss, variables)
    import jax

    def stateless(trainable, non_trainable):
        mapping = list(zip(variables, trainable)) + list(
            zip(model.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            loss = forward(model)
        return loss, [scope.get_current_value(v) for v in model.non_trainable_variables]

    (loss, non_trainable), grads = jax.value_and_grad(stateless, has_aux=True)(
        [v.value for v in variables], [v.value for v in model.non_trainable_variables])
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        if value is not None:
            variable.assign(value)  # the seeds moved as the draws moved them
    return loss, grads


def _same_draws(reference, x):
    """The large batch of the same draws: windows of 3 micro-batches of 4 (24
    samples), each micro-batch's forward pass in order, in one gradient."""
    loss = reference.loss
    reference.optimizer.build(reference.trainable_variables)

    def window(start):
        def forward(model):
            outputs = ops.concatenate([
                model([x[0][i:i + 4], x[1][i:i + 4]], training=True)
                for i in range(start, start + 12, 4)], axis=0)
            return ops.mean(loss(None, outputs))

        return forward

    for start in (0, 12):
        _, grads = loss_and_gradients(reference, window(start))
        reference.optimizer.apply(grads, reference.trainable_variables)
    return reference


@pytest.mark.keras3
def test_the_second_forward_pass_draws_the_first_passes_dropout_masks():
    """Against the large batch of the same masks: each micro-batch's forward pass
    (masks drawn in order, as the callback's first passes draw them) in one tape."""
    x, y = _data(24)
    model = build(dropout=0.5)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3)])
    reference = _same_draws(build(dropout=0.5), x)
    assert max_diff(reference, model) < 1e-5
    assert max_diff(build(dropout=0.5), model) > 1e-2


class Noise(keras.layers.Layer):
    """Multiplies its inputs by 1 + 0.3 u, u uniform, drawn from `source` (training only)."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source
        if source == "layer_seed":
            self.seed_generator = keras.random.SeedGenerator(7)
        if source == "tf_generator":
            import tensorflow as tf

            self.generator = tf.random.Generator.from_seed(1)

    def call(self, inputs, training=False):
        if not training:
            return inputs
        if self.source == "layer_seed":
            return inputs * (1.0 + 0.3 * keras.random.uniform(ops.shape(inputs),
                                                              seed=self.seed_generator))
        if self.source == "global_seed":
            return inputs * (1.0 + 0.3 * keras.random.uniform(ops.shape(inputs)))
        if self.source == "numpy":  # drawn as JAX traces the step: a constant of the trace
            return inputs * (1.0 + 0.3 * np.random.uniform(size=inputs.shape[1:]))
        import tensorflow as tf

        shape = tf.shape(inputs)
        if self.source == "tf_stateful":
            noise = tf.random.uniform(shape)
        elif self.source == "tf_stateful_in_a_cond":
            noise = tf.cond(shape[0] > 0, lambda: tf.random.uniform(shape), lambda: tf.zeros(shape))
        elif self.source == "tf_generator":
            noise = self.generator.uniform(shape)
        return inputs * (1.0 + 0.3 * noise)


def _noisy(source, run_eagerly=False):
    """The two towers, the first with noise before its weights (where a replay matters)."""
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    if source == "gaussian_noise":
        noise = keras.layers.GaussianNoise(0.3, seed=5, name="noise")
    else:
        noise = Noise(source, name="noise")
    model = keras.Model([first, second], keras.layers.Concatenate()(
        [_tower()(noise(first)), _tower()(second)]))
    model.compile(_optimizer("adamw"), loss=LOSSES["in_batch"](), jit_compile=False,
                  run_eagerly=run_eagerly)
    return model


SEEDED = ["layer_seed", "gaussian_noise"] + [
    pytest.param("global_seed", marks=pytest.mark.backend(
        "tensorflow", reason="Keras' JAX trainer refuses unseeded random ops in a traced step"))]


@pytest.mark.keras3
@pytest.mark.parametrize("source", SEEDED)
def test_noise_drawn_from_seed_generators_is_replayed_exactly(source):
    """Against the large batch of the same draws: each micro-batch's forward pass
    in order (as the callback's first passes draw them), in one tape."""
    x, y = _data(24)
    model = _noisy(source)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3)])
    reference = _same_draws(_noisy(source), x)
    assert max_diff(reference, model) < 1e-5
    assert max_diff(_noisy(source), model) > 1e-2


@pytest.mark.keras3
@pytest.mark.backend("tensorflow", reason="TensorFlow's stateful random ops (on JAX: "
                     "test_noise_a_jax_replay_cannot_draw_again_is_refused_at_the_first_window)")
@pytest.mark.parametrize("source, run_eagerly, op", [
    ("tf_stateful", False, "RandomUniform"),
    ("tf_stateful_in_a_cond", False, "RandomUniform"),
    ("tf_generator", False, "RngReadAndSkip"),
    ("tf_stateful", True, "RandomUniform"),
], ids=["tf_stateful", "in_a_cond", "tf_generator", "run_eagerly"])
def test_noise_the_replay_cannot_draw_again_is_refused_by_name(source, run_eagerly, op):
    x, y = _data(16)
    model = _noisy(source, run_eagerly=run_eagerly)
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(RuntimeError, match=rf"cannot draw again: a stateful TensorFlow random op "
                       rf"\({op}, '[^']*'\) in layer 'noise'.*seed=self.seed_generator"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(accumulation_steps=2)])
    assert tfaccum.AccumulationHook.installed_on(model) is None
    assert max_diff(before, model) == 0


@pytest.mark.backend("jax", reason="a trace's NumPy draws (TensorFlow's stateful ops: "
                     "test_noise_the_replay_cannot_draw_again_is_refused_by_name)")
def test_noise_a_jax_replay_cannot_draw_again_is_refused_at_the_first_window():
    x, y = _data(16)
    model = _noisy("numpy")
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"cannot draw again: the first window's replayed "
                       r"outputs differ .*seed=self.seed_generator"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(accumulation_steps=2)])
    assert tfaccum.AccumulationHook.installed_on(model) is None
    assert max_diff(before, model) == 0


def mean_output(y_true, y_pred):
    return ops.mean(y_pred, axis=-1)


def _subclassed(cls):
    """The two towers as an instance of `cls` (a Model overriding one of Keras' steps)."""
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    model = cls([first, second], keras.layers.Concatenate()([_tower()(first), _tower()(second)]))
    model.compile("sgd", loss=tfaccum.InBatchSoftmax(), jit_compile=False)
    return model


def _override():
    class Own(keras.Model):
        def train_step(self, *args):  # (data), or JAX's (state, data)
            return super().train_step(*args)

    return _subclassed(Own)


def _own_compute_loss():
    class Own(keras.Model):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    return _subclassed(Own)


def _masked_output():
    """An output carrying a per-sample Keras mask (`Masking` on the joined inputs)."""
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    joined = keras.layers.Masking(0.0)(keras.layers.Concatenate()([first, second]))
    model = keras.Model([first, second], keras.layers.Dense(8)(joined))
    model.compile("sgd", loss=tfaccum.InBatchSoftmax(), jit_compile=False)
    return model


def _batch_norm():
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    tower = keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization(),
                              keras.layers.Dense(4)])
    model = keras.Model([first, second], keras.layers.Concatenate()([tower(first), tower(second)]))
    model.compile("sgd", loss=tfaccum.InBatchSoftmax(), jit_compile=False)
    return model


REFUSED = [
    (build, dict(noise_scale=True), r"cannot meet noise_scale=True"),
    (build, dict(reduction="mean"), r"cannot meet reduction='mean'.*Leave reduction=\"auto\""),
    (build, dict(skip_nonfinite=True), r"cannot meet skip_nonfinite=True"),
    (build, dict(accumulator_dtype="bfloat16"), r"cannot meet accumulator_dtype='bfloat16'"),
    (lambda: build(metrics=[mean_output]), {}, r"cannot meet compiled `metrics=`"),
    pytest.param(lambda: build(jit_compile=True), {},
                 r"cannot meet jit_compile=True.*jit_compile=False",
                 marks=pytest.mark.backend("tensorflow", reason="JAX compiles a window of any "
                                           "length: every test here runs compiled on JAX")),
    # (On JAX the hook refuses any model's own train_step first.)
    (_override, {}, r"(cannot meet|does not serve) a `train_step` of its own"),
    (_own_compute_loss, {}, r"cannot meet a `compute_loss` of its own"),
    (_masked_output, {}, r"has an output with a Keras mask"),
    (_batch_norm, {}, r"cannot meet batch normalization \(layers \['batch_normalization"),
    (lambda: build(regularizer=keras.regularizers.L2(0.1)), {}, r"adds losses of its own \(`model.losses`"),
]


@pytest.mark.parametrize("make, kwargs, message", REFUSED,
                         ids=["noise_scale", "reduction", "skip_nonfinite", "bfloat16", "metrics",
                              "jit_compile", "train_step", "compute_loss", "masked_output",
                              "batch_norm", "regularizer"])
def test_what_a_window_loss_cannot_meet_is_refused_by_name(make, kwargs, message):
    x, y = _data(16)
    model = make()
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=2, **kwargs)
    with pytest.raises((ValueError, RuntimeError), match=message):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
    assert tfaccum.AccumulationHook.installed_on(model) is None
    before = [np.array(w) for w in model.get_weights()]
    model.fit(x, y, batch_size=4, verbose=0)  # a plain model again
    assert max_diff(before, model) > 0


@pytest.mark.keras3
@ON_TENSORFLOW
@pytest.mark.parametrize("case", [
    dict(loss="in_batch", optimizer="sgd_momentum", leftover="flush", log_dir=True),
    dict(loss="clip", optimizer="adamw", leftover="drop"),
], ids=["in_batch-log_dir", "clip-drop"])
def test_two_replicas_gather_the_window_as_one_device(case, tmp_path):
    """Each replica's outputs are gathered once per window: two replicas equal
    one device's large batch (38 samples: a last micro-batch of 2, split 1 and 1)."""
    case = dict(case)
    leftover = case.pop("leftover")
    kwargs = dict(log_dir=str(tmp_path / "run")) if case.pop("log_dir", False) else {}
    x, y = _data(38)
    result = compare(lambda: build(**case), x, y, micro=4, steps=3, epochs=2, leftover=leftover,
                     strategy=mirrored(), callback_kwargs=kwargs)
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build(**case)) > 1e-2
    assert result.callback.optimizer_steps == len(result.updates)
    assert result.callback.samples == 76
    assert result.model.optimizer.iterations.numpy() == len(result.updates)
    if kwargs:
        from reference import read_run
        from test_summary import values

        series, _ = read_run(kwargs["log_dir"])
        assert values(series, "window_samples") == [len(u) for u in result.updates]


@pytest.mark.keras3
@ON_TENSORFLOW
def test_two_replicas_under_mixed_precision(mixed_precision):
    x, y = _data(24)
    result = compare(lambda: build(optimizer="adamw"), x, y, micro=4, steps=3, epochs=2,
                     strategy=mirrored())
    assert isinstance(result.model.optimizer, keras.optimizers.LossScaleOptimizer)
    # float16 forward passes round differently per batch shape (one device: 1e-4;
    # here each replica's share is 2 samples).
    assert result.diff < 2e-4, result.diff
    assert result.moved(lambda: build(optimizer="adamw")) > 1e-2


@pytest.mark.skipif(KERAS == "keras3", reason="Keras 3 gathers across replicas (test above)")
def test_tf_keras_replicas_are_refused_by_name():
    with mirrored().scope():
        model = build()
    x, y = _data(16)
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=r"cannot meet a tf_keras model under a strategy with 2"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])


@pytest.mark.skipif(KERAS == "keras3", reason="Keras 3's dropout replays (test above)")
def test_tf_keras_dropout_is_refused_by_name():
    x, y = _data(16)
    model = build(dropout=0.5)
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=r"cannot meet tf_keras layers that draw random numbers"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])


@pytest.mark.keras3
@pytest.mark.backend("tensorflow", reason="refused on JAX: "
                     "test_mixed_float16_is_refused_by_name_on_jax")
def test_mixed_precision_scales_the_cached_gradients(mixed_precision):
    """Under `LossScaleOptimizer` the window's loss is scaled before its gradient
    to the outputs is taken, and unscaled by the optimizer, as for the large batch."""
    x, y = _data(24)
    result = compare(lambda: build(optimizer="adamw"), x, y, micro=4, steps=3, epochs=2)
    assert isinstance(result.model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert result.model.outputs[0].dtype == "float16"
    # float16 forward passes round differently per batch shape (float16 keeps
    # about 3 digits): 0.4e-4 to 1.5e-4 measured over clean runs, as threads
    # order the CPU's sums; a window that ignored the loss scale is off by far more.
    assert result.diff < 3e-4, result.diff
    assert result.moved(lambda: build(optimizer="adamw")) > 1e-2


@pytest.mark.keras3
def test_mixed_bfloat16_windows_are_as_close_as_bfloat16_allows():
    """bfloat16 forward passes (no loss scale): about 8e-4 from the large batch
    on TensorFlow and JAX after 8 AdamW updates (its outputs keep about 3
    digits; over ten data seeds at most 1.8e-3), where training moves the
    weights by more than 0.1."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = _data(38)
        result = compare(lambda: build("in_batch", "adamw_bfloat16"), x, y, micro=4, steps=3,
                         epochs=2)
        assert result.model.outputs[0].dtype == "bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert result.diff < 5e-3, result.diff
    assert result.moved(lambda: build("in_batch", "adamw_bfloat16")) > 1e-1


@pytest.mark.keras3
@pytest.mark.backend("tensorflow", reason="refused on JAX: "
                     "test_mixed_float16_is_refused_by_name_on_jax")
def test_a_window_the_loss_scale_skips_is_not_an_update(mixed_precision):
    """A loss scale so large that every window's gradient overflows in float16:
    `LossScaleOptimizer` skips each window and lowers its scale, as it would
    the large batch; no update is counted and no weight moves."""
    x, y = _data(24)  # 6 micro-batches of 4: two windows of 3
    model = build()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5),
                                                    initial_scale=2.0**60)
    model.compile(optimizer, loss=LOSSES["in_batch"](), jit_compile=False)
    before = model.get_weights()
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=3)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert (callback.micro_steps, callback.optimizer_steps) == (6, 0)
    assert int(optimizer.iterations.numpy()) == 0
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**58  # lowered once per window
    assert max_diff(before, model.get_weights()) == 0


def test_the_dashboard_shows_the_window_loss(tmp_path):
    from reference import read_run
    from test_summary import values

    x, y = _data(24)
    log_dir = str(tmp_path / "run")
    model = build()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3, log_dir=log_dir)])
    series, _ = read_run(log_dir)
    reference = build()
    losses, norms = [], []
    for start in (0, 12):
        batch = [x[0][start:start + 12], x[1][start:start + 12]]
        loss, grads = loss_and_gradients(reference, lambda model: ops.mean(
            model.loss(None, model(batch, training=True))))
        norms.append(float(np.sqrt(sum(np.sum(np.square(g)) for g in grads))))
        losses.append(float(loss))
        reference.train_on_batch(batch, y[start:start + 12])
    np.testing.assert_allclose(values(series, "window_loss"), losses, rtol=1e-5)
    np.testing.assert_allclose(values(series, "applied_gradient_norm"), norms, rtol=1e-5)
    assert values(series, "window_samples") == [12, 12]
    # No micro-batch has a gradient of its own: its norms are not a number.
    assert all(np.isnan(values(series, "micro_norm_mean")))


def _two_outputs():
    """Embeddings with an in-batch loss, and a per-sample head with a loss of its own."""
    keras.utils.set_random_seed(3)
    first, second = keras.Input((FEATURES,)), keras.Input((FEATURES,))
    query = _tower()(first)
    embeddings = keras.layers.Concatenate(name="embeddings")([query, _tower()(second)])
    head = keras.layers.Dense(3, name="head")(query)
    model = keras.Model([first, second], {"embeddings": embeddings, "head": head})
    model.compile(_optimizer("adamw"), jit_compile=False, loss={
        "embeddings": tfaccum.InBatchSoftmax(temperature=0.5),
        "head": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        loss_weights={"embeddings": 1.0, "head": 0.5})
    return model


def test_several_outputs_each_lose_over_the_window():
    x, _ = _data(30)
    y = {"embeddings": np.zeros((30, 8), "float32"), "head": np.arange(30) % 3}
    result = compare(_two_outputs, x, y, micro=4, steps=3, epochs=2)
    assert result.diff < 1e-5, result.diff
    assert result.moved(_two_outputs) > 1e-2


def test_a_dataset_trains_as_arrays_do():
    import tensorflow as tf

    x, y = _data(30)
    dataset = tf.data.Dataset.from_tensor_slices(((x[0], x[1]), y)).batch(4)
    model = build()
    model.fit(dataset, epochs=2, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3)])
    arrays = build()
    arrays.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[
        tfaccum.GradientAccumulationCallback(accumulation_steps=3)])
    reference = build()
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_diff(reference, model) < 1e-5
    assert max_diff(arrays, model) < 1e-5
    assert max_diff(build(), model) > 1e-2


def test_a_window_left_at_removal_is_not_carried_into_a_reinstalled_hook():
    x, y = _data(20)

    def batch(start, stop):
        return [x[0][start:stop], x[1][start:stop]], y[start:stop]

    model = build()
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=3)
    for start in (0, 4):
        model.train_on_batch(*batch(start, start + 4))
    with pytest.warns(UserWarning, match="discards 2 micro-batches"):
        hook.remove()
    hook.reinstall()
    for start in (8, 12, 16):
        model.train_on_batch(*batch(start, start + 4))
    assert hook.optimizer_steps == 1
    hook.remove()
    reference = build()
    reference.train_on_batch(*batch(8, 20))
    assert max_diff(reference, model) < 1e-5
    assert max_diff(build(), model) > 1e-2


@pytest.mark.backend("tensorflow", reason="TensorFlow keeps the window in buffers of the first "
                     "layout; JAX keeps each micro-batch's arrays apart")
def test_a_new_layout_of_micro_batches_is_refused_not_ignored():
    """Sample weights in a second `fit` would not reach the kept window: refused."""
    x, y = _data(16)
    model = build()
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=2)
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback])
    with pytest.raises(RuntimeError, match=r"laid out differently .*sample_weight"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[callback],
                  sample_weight=np.ones(16, "float32"))
    assert tfaccum.AccumulationHook.installed_on(model) is None


@pytest.mark.backend("tensorflow", reason="TensorFlow keeps the window's inputs in one buffer; "
                     "JAX keeps each micro-batch's apart, whatever its length")
def test_inputs_of_unknown_length_are_refused_by_name():
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    tokens = keras.Input((None,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 8)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(8)(pooled))
    model.compile("sgd", loss=tfaccum.InBatchSoftmax(), jit_compile=False)
    # Padded to 5, then to 3: Keras 3.15 traces the step once for any length,
    # Keras 3.16 first for the first batch's, then again for any.
    lengths = [3, 5, 2, 4, 1, 3, 2, 2] * 2
    dataset = tf.data.Dataset.from_generator(
        lambda: ((np.ones(n, "int32"), np.float32(0)) for n in lengths),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32)))
    weights = [np.array(w) for w in model.get_weights()]
    with pytest.raises(RuntimeError, match=r"fixed shape per sample.*Pad them to one length"):
        model.fit(dataset.padded_batch(4), verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(accumulation_steps=2)])
    assert int(model.optimizer.iterations) == 0  # refused inside the first window
    for before, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.mark.keras3
@ON_TENSORFLOW
def test_a_strategy_of_one_replica_gathers_the_window_as_one_device():
    # MirroredStrategy on one GPU: the window ends in the cross-replica context.
    import tensorflow as tf

    one = tf.distribute.MirroredStrategy([tf.config.list_logical_devices("CPU")[0].name])
    x, y = _data(38)
    result = compare(lambda: build(loss="in_batch", optimizer="adamw"), x, y, micro=4, steps=3,
                     epochs=2, strategy=one)
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build(loss="in_batch", optimizer="adamw")) > 1e-2


@pytest.mark.backend("jax", reason="Keras' JAX trainer without jit (TensorFlow's step runs "
                     "as a tf.function with jit_compile=False in every test here)")
def test_an_uncompiled_jax_window_is_the_large_batch():
    x, y = _data(30)
    result = compare(lambda: build("nt_xent", "adamw", jit_compile=False), x, y, micro=4,
                     steps=3, epochs=2)
    assert result.diff < 1e-5, result.diff
    assert result.moved(lambda: build("nt_xent", "adamw")) > 1e-2


@pytest.mark.backend("jax", reason="keras.distribution.DataParallel (TensorFlow's replicas: "
                     "test_two_replicas_gather_the_window_as_one_device)")
@pytest.mark.parametrize("case", [
    dict(loss="in_batch", optimizer="sgd_momentum", leftover="flush", log_dir=True),
    dict(loss="clip", optimizer="adamw", leftover="drop"),
], ids=["in_batch-log_dir", "clip-drop"])
def test_data_parallel_gathers_the_window_as_one_device(case, tmp_path):
    """The window's outputs over both devices: two devices equal one device's
    large batch (38 samples: a last micro-batch of 2, split 1 and 1)."""
    from reference import fit_accumulated
    from reference import train_large_batches
    from reference import windows

    case = dict(case)
    leftover = case.pop("leftover")
    kwargs = dict(log_dir=str(tmp_path / "run")) if case.pop("log_dir", False) else {}
    x, y = _data(38)
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=3, leftover=leftover,
                                                    **kwargs)
    with keras.distribution.DataParallel().scope():
        model = build(**case)
        ours, callback = fit_accumulated(model, x, y, micro=4, steps=3, epochs=2,
                                         callback=callback)
    assert callback.hook.devices.shares == 2
    updates = windows(38, 4, 3, 2, leftover)
    theirs = train_large_batches(build(**case), x, y, updates)
    from reference import largest_update_diff

    assert len(ours) == len(theirs)
    assert largest_update_diff(ours, theirs) < 1e-5
    assert max_diff(build(**case), model) > 1e-2
    assert callback.samples == 76
    if kwargs:
        from reference import read_run
        from test_summary import values

        series, _ = read_run(kwargs["log_dir"])
        assert values(series, "window_samples") == [len(u) for u in updates]


@pytest.mark.backend("jax", reason="served on TensorFlow: "
                     "test_mixed_precision_scales_the_cached_gradients")
def test_mixed_float16_is_refused_by_name_on_jax(mixed_precision):
    x, y = _data(16)
    model = build(optimizer="adamw")
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"cannot meet mixed_float16's LossScaleOptimizer on "
                       r"Keras' JAX backend.*Use mixed_bfloat16"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[
            tfaccum.GradientAccumulationCallback(accumulation_steps=2)])
    assert tfaccum.AccumulationHook.installed_on(model) is None
    assert max_diff(before, model) == 0
    # Installed by hand before `fit` builds the optimizer's variables: the same.
    with pytest.raises(ValueError, match=r"cannot meet mixed_float16's LossScaleOptimizer"):
        tfaccum.install_accumulation_hook(build(optimizer="adamw"), accumulation_steps=2)


def _retrieval():
    """keras-rs' basic retrieval with its in-batch softmax as a window-wide loss:
    user and item towers (embeddings of ids), each user's item the positive,
    the window's other items the negatives, an item met twice in a window not
    its own negative (`keras_rs.layers.RemoveAccidentalHits`)."""
    import keras_rs

    keras.utils.set_random_seed(3)
    users, items = keras.Input((1,), dtype="int32"), keras.Input((1,), dtype="int32")

    def tower(ids):
        # No bias: an item bias moves every score of a user alike, so its gradient
        # is 0 and Adam would turn rounding noise into full steps.
        return keras.Sequential([keras.layers.Embedding(ids, 8), keras.layers.Flatten(),
                                 keras.layers.Dense(8, use_bias=False)])

    model = keras.Model([users, items], keras.layers.Concatenate()(
        [tower(20)(users), tower(12)(items)]))
    remove_accidental_hits = keras_rs.layers.RemoveAccidentalHits()

    def retrieval(item_ids, y_pred):
        users, items = ops.split(y_pred, 2, axis=-1)
        scores = ops.matmul(users, ops.transpose(items))
        labels = ops.eye(ops.shape(scores)[0])
        logits = remove_accidental_hits(scores, labels,
                                        ops.reshape(ops.cast(item_ids, "int32"), (-1,)))
        return keras.losses.categorical_crossentropy(labels, logits, from_logits=True)

    model.compile(keras.optimizers.Adam(0.05), loss=tfaccum.WindowLoss(retrieval),
                  jit_compile=BACKEND != "tensorflow")
    return model


@pytest.mark.keras3
def test_a_keras_rs_retrieval_model_is_the_large_batch():
    rng = np.random.default_rng(2)
    users, items = rng.integers(0, 20, size=(38, 1)), rng.integers(0, 12, size=(38, 1))
    result = compare(_retrieval, [users, items], items.astype("float32"), micro=4, steps=3,
                     epochs=2)
    assert result.diff < 1e-5, result.diff
    assert result.moved(_retrieval) > 1e-2
