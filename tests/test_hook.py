"""AccumulationHook: install, remove, and the exact arithmetic of a window."""

import numpy as np
import pytest
import tensorflow as tf

import reference as oracle
from reference import keras
from reference import make_data
from reference import make_model
from reference import max_weight_diff

import tfaccum
from tfaccum import GradientAccumulationCallback
from tfaccum import install_accumulation_hook
from tfaccum.patching import HOOK_ATTRIBUTE
from tfaccum.observing import WindowObserver


def linear_model(**compile_kwargs):
    """w * x with w = 0 and loss mean(y_pred): a micro-batch's gradient is mean(x)."""
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss=lambda y_true, y_pred: y_pred,
                  **compile_kwargs)
    return model


# Micro-batches of sizes 2, 2, 2, 1 whose gradients are 1, 2, 3 and 4.
MICRO_BATCHES = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0]]


def train_on(model, micro_batches):
    """Trains on each micro-batch; returns the kernel w after each."""
    kernels = []
    for values in micro_batches:
        x = np.array(values, "float32")[:, None]
        model.train_on_batch(x, np.zeros_like(x))
        kernels.append(float(model.layers[0].kernel[0, 0]))
    return kernels


@pytest.mark.parametrize(
    "reduction, expected_gradient",
    [("samples", (2 * 1 + 2 * 2 + 2 * 3 + 1 * 4) / 7), ("mean", 2.5), ("sum", 10.0)],
)
def test_reductions_by_hand(reduction, expected_gradient):
    model = linear_model()
    hook = install_accumulation_hook(model, accumulation_steps=4, reduction=reduction)
    kernels = train_on(model, MICRO_BATCHES)
    # Weights do not move until the window is full; then w = 0 - 1.0 * gradient.
    assert kernels[:3] == [0.0, 0.0, 0.0]
    assert kernels[3] == pytest.approx(-expected_gradient, rel=1e-6)
    assert hook.micro_steps == 4 and hook.optimizer_steps == 1
    hook.remove()


@pytest.mark.keras3  # tf_keras' `train_on_batch` pulls `steps_per_execution` batches
def test_by_hand_under_steps_per_execution_each_train_on_batch_is_one_micro_batch():
    # Keras 3.16's JAX `fit` stacks `steps_per_execution` batches into one;
    # its `train_on_batch` still hands over one plain batch.
    model = linear_model(steps_per_execution=2)
    hook = install_accumulation_hook(model, accumulation_steps=4)
    kernels = train_on(model, MICRO_BATCHES)
    assert kernels[:3] == [0.0, 0.0, 0.0]
    assert kernels[3] == pytest.approx(-(2 * 1 + 2 * 2 + 2 * 3 + 1 * 4) / 7, rel=1e-6)
    assert hook.micro_steps == 4 and hook.optimizer_steps == 1
    hook.remove()


def test_flush_normalises_by_what_the_window_holds():
    model = linear_model()
    hook = install_accumulation_hook(model, accumulation_steps=4)
    train_on(model, MICRO_BATCHES[:3])
    assert hook.pending == tfaccum.Window(micro_batches=3, samples=6)
    assert hook.flush() == tfaccum.Window(3, 6)
    assert float(model.layers[0].kernel[0, 0]) == pytest.approx(-2.0)  # mean of 1, 2, 3
    assert hook.flushes == 1 and hook.pending == tfaccum.Window(0, 0)
    assert hook.flush() == tfaccum.Window(0, 0)  # nothing left: no update
    assert hook.flushes == 1 and int(model.optimizer.iterations) == 1
    hook.remove()


class ApplyRecorder(WindowObserver):
    """Records, for each `on_apply` call, whether it ran eagerly (else: traced)."""

    def __init__(self):
        self.eagerly = []

    def on_apply(self, state, update):
        self.eagerly.append(tf.executing_eagerly())
        return {}


@pytest.mark.backend("tensorflow", reason="TensorFlow's host-ended windows, eager then traced")
def test_the_first_two_flushes_run_eagerly_and_later_ones_compiled():
    """A flush traced for one or two uses costs more than it saves (fine-tuning
    runs an epoch or two); a third is compiled once. Both are the large batch."""
    x, y = make_data(n=30)  # 8 micro-batches of 4 an epoch: windows of 3, 3 and a flushed 2
    model, reference = make_model(optimizer="adam"), make_model(optimizer="adam")
    recorder = ApplyRecorder()
    hook = tfaccum.AccumulationHook.watched_by(model, [recorder], accumulation_steps=3)
    traced = []
    for _ in range(4):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        assert hook.flush() == tfaccum.Window(2, 6)
        traced.append(recorder.eagerly.count(False))
    hook.remove()
    assert hook.flushes == 4 and hook.optimizer_steps == 12
    assert recorder.eagerly.count(True) == 2  # the first two flushes
    # Traced: the step's window end (once per step trace), the third flush once.
    assert traced[1] == traced[0] and traced[3] == traced[2] == traced[1] + 1
    theirs = oracle.train_large_batches(reference, x, y, oracle.windows(30, 4, 3, epochs=4))
    assert max_weight_diff(model, theirs[-1]) < 1e-6
    assert max_weight_diff(model, make_model(optimizer="adam")) > 1e-2  # it trained


def test_drop_discards_and_counts():
    model = linear_model()
    hook = install_accumulation_hook(model, accumulation_steps=4)
    train_on(model, MICRO_BATCHES[:2])
    assert hook.drop() == tfaccum.Window(2, 4)
    assert hook.dropped_micro_steps == 2
    assert float(model.layers[0].kernel[0, 0]) == 0.0
    assert int(model.optimizer.iterations) == 0
    hook.remove()


def test_context_manager_flushes_and_removes():
    x, y = make_data()
    reference = make_model(optimizer="adam")
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = make_model(optimizer="adam")
    with install_accumulation_hook(model, accumulation_steps=4) as hook:
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(reference, model) < 1e-5
    assert not hook.installed and "train_step" not in model.__dict__
    assert hook.flushes == 1


def test_removing_with_a_pending_window_warns():
    model = linear_model()
    hook = install_accumulation_hook(model, accumulation_steps=4)
    train_on(model, MICRO_BATCHES[:1])
    with pytest.warns(UserWarning, match=r"discards 1 micro-batches \(2 samples\)"):
        hook.remove()


def test_model_is_plain_after_fit(tmp_path):
    x, y = make_data()
    model = make_model(optimizer="adam")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert "train_step" not in model.__dict__
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # no custom_objects needed
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # A later fit without the callback updates every batch.
    before = int(model.optimizer.iterations)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) - before == 13


@pytest.mark.keras3  # tf_keras' optimizer `variables` is a method
def test_after_fit_a_plain_fit_equals_plain_keras_from_the_same_state():
    # The optimizer holds its own variables only (no accumulator left in it),
    # and goes on from them as plain Keras does.
    x, y = make_data(n=64)
    model = make_model(optimizer="adam")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    plain = make_model(optimizer="adam")
    plain.set_weights(model.get_weights())
    plain.optimizer.build(plain.trainable_variables)
    assert len(plain.optimizer.variables) == len(model.optimizer.variables)
    for variable, value in zip(plain.optimizer.variables, model.optimizer.variables):
        variable.assign(np.array(value))  # a copy: JAX's `fit` donates the model's arrays
    for m in (model, plain):
        m.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert max_weight_diff(model, plain) < 1e-6


def test_hook_is_removed_when_fit_is_interrupted_and_refit():
    x, y = make_data()
    model = make_model(optimizer="sgd")

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4), Interrupt()])
    assert HOOK_ATTRIBUTE in vars(model)  # Keras told no callback
    with pytest.warns(UserWarning, match="did not finish"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert HOOK_ATTRIBUTE not in vars(model)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert tfaccum.remove_accumulation_hook(model) is None


class ManualStepModel(keras.Model):
    """A custom train_step that follows the contract: it applies through self.optimizer."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(7, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y[:, 0], self(x, training=True)[:, 0])
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@pytest.mark.backend(
    "tensorflow",
    reason="a train_step of its own is refused by name on JAX "
    "(test_jax.py::test_a_train_step_of_its_own_is_refused_by_name)")
def test_custom_train_step_that_applies_through_the_optimizer():
    x, y = make_data()

    def build():
        keras.utils.set_random_seed(1)
        model = ManualStepModel()
        model(np.zeros((1, 5), "float32"))
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        return model

    reference = build()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = build()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert max_weight_diff(reference, model) < 1e-5


class AssignsWeightsModel(ManualStepModel):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        for grad, variable in zip(grads, self.trainable_variables):
            variable.assign_sub(0.01 * grad)
        return {"loss": loss}


@pytest.mark.backend(
    "tensorflow",
    reason="a train_step of its own is refused by name on JAX "
    "(test_jax.py::test_a_train_step_of_its_own_is_refused_by_name)")
def test_custom_train_step_that_bypasses_the_optimizer_is_an_error():
    x, y = make_data()
    model = AssignsWeightsModel()
    model(np.zeros((1, 5), "float32"))
    model.compile(optimizer="sgd")
    with pytest.raises(RuntimeError, match=r"applied gradients through `self.optimizer` 0 times"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=4)])
    assert "train_step" not in model.__dict__


def test_uncompiled_model_is_an_error():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"must be compiled.*model.compile"):
        install_accumulation_hook(model, accumulation_steps=4)


@pytest.mark.keras3  # tf_keras optimizers have no gradient_accumulation_steps
def test_double_accumulation_is_an_error():
    x, y = make_data()
    model = make_model(optimizer=lambda: keras.optimizers.SGD(gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match=r"already accumulates.*gradient_accumulation_steps=4"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2)])
    assert "train_step" not in model.__dict__


def test_installing_twice_is_an_error():
    model = make_model()
    install_accumulation_hook(model, accumulation_steps=2)
    with pytest.raises(ValueError, match="already has an accumulation hook"):
        install_accumulation_hook(model, accumulation_steps=2)


def test_bad_reduction_is_an_error():
    with pytest.raises(ValueError, match=r"`reduction` must be one of 'auto', 'samples', 'mean', 'sum' or a tfaccum.Reduction. Received: reduction='avg'"):
        install_accumulation_hook(make_model(), accumulation_steps=2, reduction="avg")


def test_repr():
    hook = install_accumulation_hook(make_model(), accumulation_steps=3, reduction="mean")
    assert repr(hook).startswith("AccumulationHook(model='sequential")
    assert "accumulation_steps=3, reduction='mean', installed=True, micro_steps=0" in repr(hook)
    # JAX's says which backend it runs on (TensorFlow's is the default).
    assert ("backend='jax'" in repr(hook)) == (oracle.BACKEND == "jax")


class TwoOptimizerModel(keras.Model):
    """A GAN-like step: two optimizers, neither of them `self.optimizer`."""

    def __init__(self):
        super().__init__()
        self.generator = keras.layers.Dense(5)
        self.discriminator = keras.layers.Dense(1)
        self.g_optimizer = keras.optimizers.Adam()
        self.d_optimizer = keras.optimizers.Adam()

    def call(self, x):
        return self.discriminator(self.generator(x))

    def train_step(self, data):
        x, y = data
        for layer, optimizer in ((self.discriminator, self.d_optimizer),
                                 (self.generator, self.g_optimizer)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply_gradients(zip(grads, layer.trainable_variables))
        return {"loss": loss}


@pytest.mark.backend(
    "tensorflow",
    reason="a train_step of its own is refused by name on JAX "
    "(test_jax.py::test_a_train_step_of_its_own_is_refused_by_name)")
def test_two_optimizers_get_an_error_that_says_what_is_supported():
    x, y = make_data()
    model = TwoOptimizerModel()
    model(x[:1])
    model.compile()  # Keras gives it a default `self.optimizer` it never uses
    with pytest.raises(RuntimeError, match=r"optimizers other than `self.optimizer`: "
                       r"\['d_optimizer', 'g_optimizer'\] applied gradients.*several "
                       r"optimizers .* is not supported"):
        model.fit(x, y, batch_size=8, verbose=0,
                  callbacks=[GradientAccumulationCallback(accumulation_steps=2)])
    assert "train_step" not in model.__dict__

