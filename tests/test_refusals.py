"""Every refusal leaves the model exactly as it was.

Each case is a model tfaccum refuses, at the moment it refuses it (making
the hook, the first trace, a second trace, an epoch's start, a step run
eagerly). After the refusal a plain `fit` must give the same weights, the
same optimizer variables and `optimizer.iterations` as the same model never
handed to tfaccum, including where the refused step was the first to build
an optimizer (a GAN's two, or one made lazily by the step).
"""

import dataclasses
import re
import sys
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfaccum
from reference import keras
from reference import make_data
from reference import BACKEND
from reference import make_model
from reference import not_on_torch
from reference import mirrored

ACCUMULATE = dict(accumulation_steps=2)


def _values(variables):
    variables = variables() if callable(variables) else variables
    return [np.array(v) for v in variables]


class _GAN(keras.Model):
    """A GAN as in Keras' examples: two optimizers, applied in its own `train_step`."""

    def __init__(self, lazy=False):
        super().__init__()
        self.discriminator = keras.Sequential([
            keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5)])
        self.lazy = lazy

    def compile(self, d_optimizer, g_optimizer):
        super().compile(**(dict(optimizer=g_optimizer) if self.lazy else {}))
        self.d_optimizer = None if self.lazy else d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real = data[0] if isinstance(data, tuple) else data
        n = tf.shape(real)[0]
        noise = tf.random.stateless_normal((n, 3), seed=[1, 2])
        if self.d_optimizer is None:  # made by the first step
            self.d_optimizer = keras.optimizers.Adam(0.01)
        fake = self.generator(noise)
        both = tf.concat([fake, real], 0)
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((n, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        optimizer = self.optimizer if self.lazy else self.g_optimizer
        optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def _gan(lazy=False, run_eagerly=False):
    keras.utils.set_random_seed(4)
    model = _GAN(lazy)
    model.compile(keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02))
    model.run_eagerly = run_eagerly
    return model


class Applies(keras.Sequential):
    """Applies its gradients `applies` times (0: updates its weights by hand)."""

    applies = 0

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        if not self.applies:
            for variable, grad in zip(self.trainable_variables, grads):
                variable.assign_sub(0.1 * grad)
        for _ in range(self.applies):
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


def _applying(applies):
    keras.utils.set_random_seed(1)
    model = Applies([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.applies = applies
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _shared_batch_norm():
    keras.utils.set_random_seed(1)
    first, second = keras.Input((5,)), keras.Input((5,))
    bn = tfaccum.AccumBatchNormalization(momentum=0.5)
    joined = keras.layers.Concatenate()([bn(first), bn(second)])
    model = keras.Model([first, second], keras.layers.Dense(1)(joined))
    model.compile(optimizer="adam", loss="mse")
    return model


def _counted_twice():
    from test_items import CountedBy
    from test_items import sequence_model

    model = sequence_model(mask_zero=False)
    model.compile(optimizer="adam", loss=CountedBy(lambda n: n, twice=True))
    return model


def _window_loss(**kwargs):
    from test_gradient_cache import build

    return build(optimizer="adamw", **kwargs)


def _window_loss_batch_norm():
    from test_gradient_cache import _batch_norm

    return _batch_norm()


def _window_loss_masked():
    from test_gradient_cache import _masked_output

    return _masked_output()


def _window_loss_noise():
    from test_gradient_cache import _noisy

    return _noisy("tf_stateful")


def _tokens():
    from test_items import sequences

    tokens, _, ignored, _ = sequences()
    return tokens, ignored


def _pairs():
    from test_gradient_cache import _data

    return _data(16)


def _mirrored_model():
    with mirrored().scope():
        return make_model(optimizer="adam")


def _regularized():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
        3, kernel_regularizer=keras.regularizers.L2(0.1)), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _built_in_accumulation():
    return make_model(optimizer=lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))


class FailingReduction(tfaccum.Reduction):
    """A reduction of one's own that fails at the first window's end."""

    name = "failing"

    def weight(self, samples, items, open_window):
        return samples

    def denominator(self, window):
        raise ValueError("this reduction cannot divide")


@dataclasses.dataclass
class Case:
    build: object  # () -> a compiled model
    match: str  # what the refusal says
    data: object = lambda: make_data(n=16)
    callback: dict = dataclasses.field(default_factory=lambda: dict(ACCUMULATE))
    fit: dict = dataclasses.field(default_factory=dict)  # the refused fit's own arguments
    before: bool = False  # a first fit, accumulated, of both models
    keras3: bool = False
    tensorflow_only: str = ""  # why the case is TensorFlow's only (a `backend` marker)
    torch_match: str = ""  # what the refusal says on torch, where it differs
    not_on_torch: str = ""  # a key of reference.NOT_ON_TORCH


# On torch a window-wide loss is refused whole, before what it cannot meet is asked.
WINDOW_LOSS_ON_TORCH = r"PyTorch backend does not serve window-wide losses"

# Why cases are TensorFlow's: JAX refuses the whole feature, by name, with its own test.
OWN_STEP = ("a train_step written with tf.GradientTape; JAX refuses a model's own train_step "
            "(test_jax.py::test_a_train_step_of_its_own_is_refused_by_name)")
UNREPLAYABLE = ("TensorFlow's stateful random ops; on JAX, NumPy's draws differ between any "
                "two traces, two plain fits too (the refusal leaves the model as it was: "
                "test_gradient_cache.py::test_noise_a_jax_replay_cannot_draw_again_is_refused_"
                "at_the_first_window)")
SECOND_LAYOUT = ("TensorFlow keeps the window in buffers of the first layout; JAX keeps each "
                 "micro-batch's arrays apart, whatever their layout")


CASES = {
    "several_optimizers": Case(_gan, r"optimizers other than `self.optimizer`: \['d_optimizer', "
                               r"'g_optimizer'\]", data=lambda: (make_data(n=16)[0], None),
                               tensorflow_only=OWN_STEP),
    "several_optimizers_eager": Case(lambda: _gan(run_eagerly=True),
                                     r"optimizers other than `self.optimizer`",
                                     data=lambda: (make_data(n=16)[0], None),
                                     tensorflow_only=OWN_STEP),
    "optimizer_made_in_the_step": Case(lambda: _gan(lazy=True),
                                       r"\['d_optimizer'\] were made in the step",
                                       data=lambda: (make_data(n=16)[0], None),
                                       tensorflow_only=OWN_STEP),
    "no_apply": Case(lambda: _applying(0), r"applied gradients through `self.optimizer` 0 times",
                     tensorflow_only=OWN_STEP),
    "two_applies": Case(lambda: _applying(2), r"applied gradients through `self.optimizer` 2 times",
                        tensorflow_only=OWN_STEP),
    "built_in_accumulation": Case(_built_in_accumulation, r"gradient_accumulation_steps=2",
                                  keras3=True),
    "sum_with_regularizers": Case(_regularized, r"reduction='sum' adds",
                                  callback=dict(ACCUMULATE, reduction="sum")),
    "reduction_failing_at_the_first_window_end": Case(
        make_model, r"cannot divide", callback=dict(ACCUMULATE, reduction=FailingReduction())),
    "noise_scale_at_an_epoch": Case(make_model, r"noise scale .* accumulation_steps\(0\) = 1",
                                    callback=dict(accumulation_steps={1: 2}, noise_scale=True)),
    "mean_with_a_replicas_share_left_out": Case(
        _mirrored_model, r"cannot weigh", callback=dict(ACCUMULATE, reduction="mean",
                                                        skip_nonfinite=True),
        tensorflow_only="two MirroredStrategy replicas leave out their own shares (under JAX's "
                        "DataParallel a micro-batch is left out whole: test_jax.py::"
                        "test_data_parallel_leaves_a_non_finite_micro_batch_out_whole)"),
    "shared_batch_norm": Case(_shared_batch_norm, r"is called 2 times in one train step",
                              data=lambda: ([make_data(n=16)[0]] * 2, make_data(n=16)[1]),
                              keras3=True, not_on_torch="batch_norm"),
    "count_items_twice": Case(_counted_twice, r"`count_items\(\)` was called 2 times",
                              data=_tokens, keras3=True),
    "window_loss_with_batch_norm": Case(_window_loss_batch_norm, r"cannot meet batch normalization",
                                        data=_pairs, torch_match=WINDOW_LOSS_ON_TORCH),
    "window_loss_masked_output": Case(_window_loss_masked, r"has an output with a Keras mask",
                                      data=_pairs, torch_match=WINDOW_LOSS_ON_TORCH),
    "window_loss_with_own_losses": Case(
        lambda: _window_loss(regularizer=keras.regularizers.L2(0.1)),
        r"adds losses of its own", data=_pairs, torch_match=WINDOW_LOSS_ON_TORCH),
    "window_loss_unreplayable_noise": Case(_window_loss_noise, r"cannot draw again",
                                           data=_pairs, keras3=True,
                                           tensorflow_only=UNREPLAYABLE),
    "window_loss_second_layout": Case(
        _window_loss, r"laid out differently", data=_pairs, before=True,
        fit=dict(sample_weight=np.ones(16, "float32")), tensorflow_only=SECOND_LAYOUT),
}


def _plain_fit(model, x, y):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hook left by an aborted fit is removed, with a warning
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)


def _optimizers(model):
    found = [model.optimizer] + [getattr(model, name, None)
                                 for name in ("d_optimizer", "g_optimizer")]
    return [o for o in found if o is not None]


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.keras3] * case.keras3 + [pytest.mark.backend(
        "tensorflow", reason=case.tensorflow_only)] * bool(case.tensorflow_only)
        + ([not_on_torch(case.not_on_torch)] if case.not_on_torch else []))
    for name, case in CASES.items()])
def test_after_a_refusal_a_plain_fit_equals_a_model_never_accumulated(name):
    case = CASES[name]
    match = case.torch_match if BACKEND == "torch" and case.torch_match else case.match
    x, y = case.data()
    refused, never = case.build(), case.build()
    if case.before:
        for model in (refused, never):
            model.fit(x, y, batch_size=4, verbose=0, shuffle=False,
                      callbacks=[tfaccum.GradientAccumulationCallback(**ACCUMULATE)])
    with pytest.raises((ValueError, RuntimeError), match=match):
        refused.fit(x, y, batch_size=4, verbose=0, shuffle=False,
                    callbacks=[tfaccum.GradientAccumulationCallback(**case.callback)], **case.fit)
    _plain_fit(refused, x, y)
    _plain_fit(never, x, y)
    assert tfaccum.AccumulationHook.installed_on(refused) is None
    assert "train_step" not in vars(refused)
    for ours, theirs in zip(refused.get_weights(), never.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)
    assert max(np.max(np.abs(w - v)) for w, v in zip(refused.get_weights(),
                                                      case.build().get_weights())) > 1e-3
    for ours, theirs in zip(_optimizers(refused), _optimizers(never), strict=True):
        for a, b in zip(_values(ours.variables), _values(theirs.variables), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


# -- a Keras backend tfaccum does not serve (JAX: test_jax.py; PyTorch: test_torch.py) -------


@pytest.mark.keras3
def test_a_backend_tfaccum_does_not_serve_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "openvino")
    # A callback made where tf_keras is loaded may be for a tf_keras model: its
    # model is checked at `fit` (the hook's check below).
    monkeypatch.delitem(sys.modules, "tf_keras", raising=False)
    with pytest.raises(ValueError, match=r"running on its 'openvino' backend.*Received: "
                       r"keras.backend.backend\(\)='openvino'.*tensorflow, jax or torch"):
        tfaccum.GradientAccumulationCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=r"'openvino' backend"):
        tfaccum.install_accumulation_hook(make_model(), accumulation_steps=2)


# -- a Keras without a private name tfaccum reads, a Keras newer than the newest tested --------


def test_a_keras_without_a_private_name_tfaccum_reads_is_refused_at_the_first_fit(monkeypatch):
    from tfaccum._keras import private

    where = "keras.src.backend.jax.trainer.Trainer"
    monkeypatch.setattr(private, "_missing", {where: ("Trainer", "JAXTrainer")})
    x, y = make_data(n=16)
    refused, never = make_model(), make_model()
    with pytest.raises(private.KerasNotServedError, match=(
            rf"does not have: {re.escape(where)}\. Installed: Keras "
            rf"{re.escape(keras_3_version())}; tfaccum was tested up to Keras "
            rf"{re.escape(private.NEWEST_TESTED)}.*pip install 'keras==")):
        refused.fit(x, y, batch_size=4, verbose=0, shuffle=False,
                    callbacks=[tfaccum.GradientAccumulationCallback(**ACCUMULATE)])
    monkeypatch.setattr(private, "_missing", {})
    _plain_fit(refused, x, y)
    _plain_fit(never, x, y)
    assert tfaccum.AccumulationHook.installed_on(refused) is None
    for ours, theirs in zip(refused.get_weights(), never.get_weights(), strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)


def test_a_name_no_candidate_gives_is_recorded_and_raises_when_used(monkeypatch):
    from tfaccum._keras import private

    monkeypatch.setattr(private, "_missing", {})
    missing = private.module_attribute("keras.src.backend", "NoSuchTrainer", "NorThis")
    assert not missing and list(private._missing) == ["keras.src.backend.NoSuchTrainer"]
    with pytest.raises(private.KerasNotServedError, match=r"keras.src.backend.NoSuchTrainer"):
        missing()
    with pytest.raises(private.KerasNotServedError):
        private.check()
    assert private.module_attribute("keras.src.backend", "NoSuchTrainer", "backend") is (
        sys.modules["keras.src.backend"].backend)  # the first candidate this Keras has
    assert private.optional_attribute("keras.src.no_such_module", "Thing") is None


def test_a_keras_newer_than_the_newest_tested_warns_once_and_trains(monkeypatch):
    from tfaccum._keras import private

    monkeypatch.setattr(private, "NEWEST_TESTED", "3.0.0")
    monkeypatch.setattr(private, "_warned", [])
    x, y = make_data(n=16)
    model = make_model()
    with pytest.warns(UserWarning) as record:
        for _ in range(2):
            model.fit(x, y, batch_size=4, verbose=0, shuffle=False,
                      callbacks=[tfaccum.GradientAccumulationCallback(**ACCUMULATE)])
    said = [str(w.message) for w in record if "tested up to Keras 3.0.0" in str(w.message)]
    assert len(said) == 1, said
    assert f"Keras {keras_3_version()} is newer" in said[0] and "report it" in said[0]
    assert int(np.asarray(model.optimizer.iterations)) == 4  # 2 fits x 2 windows


def keras_3_version():
    import keras as keras_3

    return keras_3.__version__
