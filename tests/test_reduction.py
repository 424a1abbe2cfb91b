"""`reduction=` takes a `tfaccum.Reduction` of the user's own: the window needs nothing else."""

import pytest

from reference import compare
from reference import fit_accumulated
from reference import keras
from reference import largest_update_diff
from reference import make_data
from reference import make_model
from reference import train_large_batches
from reference import windows

import tfaccum

TOL = 1e-5


class BySamples(tfaccum.Reduction):
    """Each micro-batch weighs its samples: written by a user."""

    name = "by samples"

    def weight(self, samples, items, open_window):
        return samples

    def denominator(self, window):
        return window["window_samples"]


class EqualMicroBatches(tfaccum.Reduction):
    """Each micro-batch weighs the same, whatever it holds."""

    name = "equal micro-batches"
    per_micro_batch = True

    def denominator(self, window):
        return window["window_micro_batches"] - window["window_nonfinite"]


def fit(reduction, n=99, **kwargs):
    x, y = make_data(n=n)
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=5, reduction=reduction,
                                                    **kwargs)
    return fit_accumulated(make_model(optimizer="adam"), x, y, micro=8, steps=5, epochs=2,
                           callback=callback)


def test_a_reduction_of_ones_own_equals_the_large_batch():
    # Each epoch's last window holds micro-batches of 8, 8 and 3: weights matter.
    x, y = make_data(n=99)
    ours, callback = fit(BySamples())
    theirs = train_large_batches(make_model(optimizer="adam"), x, y, windows(99, 8, 5, 2))
    assert largest_update_diff(ours, theirs) < TOL
    assert callback.reduction.name == "by samples"
    mean, _ = fit(EqualMicroBatches())  # weighting matters here: it is measurably off
    assert largest_update_diff(mean, theirs) > 1e-3


def test_it_weighs_as_the_built_in_one_it_rewrites():
    for custom, name in ((BySamples(), "samples"), (EqualMicroBatches(), "mean")):
        ours, _ = fit(custom)
        built_in, _ = fit(name)
        assert largest_update_diff(ours, built_in) < 1e-6, name


@pytest.mark.backend("tensorflow", reason="tf.distribute replicas leave out their own shares "
                     "(under JAX's DataParallel a micro-batch is left out whole: test_jax.py::"
                     "test_data_parallel_leaves_a_non_finite_micro_batch_out_whole)")
def test_with_two_replicas_and_a_left_out_share_it_is_refused_where_it_cannot_weigh():
    from reference import mirrored

    with mirrored().scope():
        model = make_model()
    x, y = make_data(n=32)
    with pytest.raises(ValueError, match=r"reduction=EqualMicroBatches\(\) \(every micro-batch "
                       r"weighs the same\) cannot weigh"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[tfaccum.GradientAccumulationCallback(
            accumulation_steps=2, reduction=EqualMicroBatches(), skip_nonfinite=True)])


def test_a_reduction_class_instead_of_an_instance_is_refused():
    with pytest.raises(TypeError, match=r"`reduction` takes an instance of a Reduction class.*"
                       r"Pass reduction=BySamples\(\)"):
        tfaccum.GradientAccumulationCallback(accumulation_steps=2, reduction=BySamples)


def test_config_and_repr_keep_it():
    callback = tfaccum.GradientAccumulationCallback(accumulation_steps=2, reduction=BySamples())
    assert "reduction=BySamples()" in repr(callback)
    again = tfaccum.GradientAccumulationCallback(**callback.get_config())
    assert isinstance(again.reduction, BySamples)
    assert repr(tfaccum.GradientAccumulationCallback(accumulation_steps=2)).count(
        "reduction='auto'") == 1


def test_sum_with_weight_regularizers_is_refused_by_name():
    # Each micro-batch's gradient carries the regularizers' once: a summed
    # window would apply them N times, the large batch once.
    x, y = make_data(n=16)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)),
                              keras.layers.Dense(1, kernel_regularizer="l2", name="dense")],
                             name="regularized")
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match=r"reduction='sum' adds the micro-batches' gradients.*"
                       r"Received: reduction='sum' with regularized weights \['regularized/dense/kernel'\]"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[tfaccum.GradientAccumulationCallback(
            accumulation_steps=2, reduction="sum")])
    model.fit(x, y, batch_size=4, verbose=0)  # plain
    assert int(model.optimizer.iterations) == 4


@pytest.mark.parametrize("reduction", ["samples", "mean", "sum"])
def test_each_built_in_reduction_through_fit(reduction):
    # Equal micro-batches: "mean" is the large batch; "sum" with a summed loss too.
    x, y = make_data(n=64)
    loss = keras.losses.MeanSquaredError(reduction="sum") if reduction == "sum" else "mse"

    def build():
        return make_model(optimizer="sgd", loss=loss)

    result = compare(build, x, y, micro=8, steps=4, callback_kwargs={"reduction": reduction})
    assert result.diff < TOL
    assert result.moved(build) > 1e-3
