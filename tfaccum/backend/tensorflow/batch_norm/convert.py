"""`convert_batch_norm`: a model's `BatchNormalization` layers made accumulation-aware.

Converts Keras 3 models with `tfaccum.AccumBatchNormalization` and tf_keras
(Keras 2) models with `keras2.AccumBatchNormalization` (this package's); a
converted layer is saved as the `BatchNormalization` it was.
"""

import collections
import os
import tempfile
import warnings

import keras

from tfaccum.backend.tensorflow import _keras_on_tf
from tfaccum.backend.tensorflow.batch_norm.layers import AccumBatchNormalization
from tfaccum.backend.tensorflow.batch_norm.moments import accumulating_layers
from tfaccum.backend.tensorflow.batch_norm.moments import saved_as
from tfaccum.backend.tensorflow.batch_norm.moments import WindowedMoments


def convert_batch_norm(model, in_place=False, verbose=1):
    """Makes every `BatchNormalization` of `model` accumulation-aware.

    Each `keras.layers.BatchNormalization`, at any depth (a backbone nested in
    a functional model, Sequential inside functional, a keras_hub backbone
    inside its task), becomes an `AccumBatchNormalization`: the same layer,
    configuration and weights (moving statistics included), only its class
    changes. The model keeps its kind: a keras_hub task stays that task, with
    its preprocessor.

    Args:
        model: A Keras 3 or tf_keras (Keras 2) model of any kind.
        in_place: `False` (default): convert a copy (made by saving and
            loading the model in memory, so it must be serializable) and
            leave `model` as it was. `True`: convert `model` itself, which
            works for any model, subclassed ones included; a model already
            trained must be compiled again afterwards.
        verbose: `1` prints how many layers were converted; `0` is silent.

    Returns:
        The converted model (`model` itself if `in_place`).

    Raises:
        ValueError: for a subclass of `BatchNormalization` (its own code
            would be lost: make it subclass `AccumBatchNormalization`
            instead); for a model that cannot be copied (pass `in_place=True`).

    Example:

    ```python
    backbone = keras.applications.MobileNetV2(include_top=False, weights=None)
    inputs = keras.Input((96, 96, 3))
    outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(backbone(inputs)))
    model = tfaccum.convert_batch_norm(keras.Model(inputs, outputs))
    # Converted 52 BatchNormalization layers to AccumBatchNormalization.
    ```
    """
    kind = _kind_of(model)
    if not isinstance(in_place, bool):
        raise ValueError(f"`in_place` must be True or False. Received: in_place={in_place!r}")
    if type(verbose) is not int or verbose not in (0, 1):
        raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    _refuse_batch_norm_subclasses(model, kind.batch_norm)
    target = model if in_place else _copy(model, kind.load_model)
    converted = 0
    for layer in _keras_on_tf.flatten_layers(target):
        if type(layer) is kind.batch_norm:
            layer.__class__ = kind.converted
            converted += 1
    if in_place and converted:
        _keras_on_tf.forget_traced_functions(target)
    if verbose:
        _keras_on_tf.print_msg(f"Converted {converted} BatchNormalization layer"
                               f"{'' if converted == 1 else 's'} to AccumBatchNormalization.")
    if not converted and not accumulating_layers(target):
        warnings.warn(
            f"`convert_batch_norm` found no BatchNormalization layer in model "
            f"{model.name!r}: nothing was converted.",
            stacklevel=2,
        )
    return target


_Kind = collections.namedtuple("_Kind", "batch_norm converted load_model")


def _kind_of(model):
    """The classes a Keras 3 or a tf_keras (Keras 2) model converts with."""
    if isinstance(model, keras.Model):
        return _Kind(keras.layers.BatchNormalization, ConvertedBatchNormalization,
                     keras.models.load_model)
    if _keras_on_tf.is_tf_keras_model(model):
        import tf_keras

        from tfaccum.backend.tensorflow.batch_norm import keras2

        return _Kind(tf_keras.layers.BatchNormalization, keras2.ConvertedBatchNormalization,
                     tf_keras.models.load_model)
    raise ValueError(f"`model` must be a Keras model. Received: model={model!r}")


class ConvertedBatchNormalization(AccumBatchNormalization):
    """What `convert_batch_norm` makes of a `BatchNormalization`: saved as one.

    An `AccumBatchNormalization` that is saved exactly as the
    `keras.layers.BatchNormalization` it was (same class name in the config
    and the weights file), so a converted model saves and loads anywhere,
    without tfaccum, and so do models that rebuild their layers from their
    arguments when loaded (keras_hub backbones). A loaded model has plain
    `BatchNormalization` again: convert it again to keep accumulating.
    """


saved_as(ConvertedBatchNormalization, keras.layers.BatchNormalization)


def _refuse_batch_norm_subclasses(model, batch_norm):
    subclasses = [
        f"{layer.name!r} ({type(layer).__name__})"
        for layer in _keras_on_tf.flatten_layers(model)
        if isinstance(layer, batch_norm)
        and not isinstance(layer, WindowedMoments)
        and type(layer) is not batch_norm
    ]
    if subclasses:
        raise ValueError(
            "`convert_batch_norm` converts `keras.layers.BatchNormalization` "
            "itself; these layers subclass it, and their own code would be "
            f"lost: {', '.join(subclasses)}. Make them subclass "
            "`tfaccum.AccumBatchNormalization` instead."
        )


def _copy(model, load_model):
    """A copy of `model`: saved and loaded (weights, assets and its class kept)."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        try:
            model.save(path)
            return load_model(path, compile=False, safe_mode=False)
        except Exception as error:  # noqa: BLE001 - any reason it cannot be copied
            raise ValueError(
                f"`convert_batch_norm` could not copy model {model.name!r} (a "
                f"{type(model).__name__}) by saving and loading it: "
                f"{type(error).__name__}: {error}. Pass `in_place=True` to convert "
                "the model itself, or use `tfaccum.AccumBatchNormalization` in "
                "its code."
            ) from error
