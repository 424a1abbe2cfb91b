"""`convert_batch_norm`: a model's `BatchNormalization` layers made accumulation-aware.

Converts Keras 3 models with the `AccumBatchNormalization` of the backend
Keras runs on (each backend's `batch_norm` names its
`ConvertedBatchNormalization`) and tf_keras (Keras 2) models with the
TensorFlow backend's `keras2` twin; a converted layer is saved as the
`BatchNormalization` it was (`saved_as`).
"""

from __future__ import annotations

import collections
import importlib
import os
import tempfile
import warnings

import keras

from tfaccum import _keras


def convert_batch_norm(model, in_place: bool = False, verbose: int = 1):
    """Makes every `BatchNormalization` of `model` accumulation-aware.

    Each `keras.layers.BatchNormalization`, at any depth (a backbone nested in
    a functional model, Sequential inside functional, a keras_hub backbone
    inside its task), becomes an `AccumBatchNormalization`: the same layer,
    configuration and weights (moving statistics included), only its class
    changes. The model keeps its kind: a keras_hub task stays that task, with
    its preprocessor.

    Args:
        model (keras.Model): A Keras 3 or tf_keras (Keras 2) model of any kind.
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
    for layer in _keras.flatten_layers(target):
        if type(layer) is kind.batch_norm:
            layer.__class__ = kind.converted
            converted += 1
    if in_place and converted:
        # Keras traces the train, test and predict functions again at their next
        # use (private: the `*_function` attributes, Keras 3.5-3.16, tf_keras).
        target.train_function = target.test_function = target.predict_function = None
    if verbose:
        _keras.print_msg(f"Converted {converted} BatchNormalization layer"
                               f"{'' if converted == 1 else 's'} to AccumBatchNormalization.")
    if not converted and not any(_accumulates(layer) for layer in _keras.flatten_layers(target)):
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
        import tfaccum

        tfaccum.AccumBatchNormalization  # noqa: B018 (refused by name where not served)
        backend = importlib.import_module(
            f"tfaccum.backend.{keras.backend.backend()}.batch_norm")
        return _Kind(keras.layers.BatchNormalization, backend.ConvertedBatchNormalization,
                     keras.models.load_model)
    if _keras.is_tf_keras_model(model):
        keras2 = importlib.import_module("tfaccum.backend.tensorflow.batch_norm.keras2")
        return _Kind(*keras2.conversion())
    raise ValueError(f"`model` must be a Keras model. Received: model={model!r}")


def saved_as(cls, original):
    """Makes Keras save `cls` as `original`: same name and module.

    What `convert_batch_norm` makes of a `BatchNormalization` (each backend's
    `ConvertedBatchNormalization`) is an `AccumBatchNormalization` saved
    exactly as the layer it was (same class name in the config and the
    weights file), so a converted model saves and loads anywhere, without
    tfaccum, and so do models that rebuild their layers from their arguments
    when loaded (keras_hub backbones). A loaded model has plain
    `BatchNormalization` again: convert it again to keep accumulating.
    """
    cls.__name__ = original.__name__
    cls.__qualname__ = original.__qualname__
    cls.__module__ = original.__module__
    return cls


def _accumulates(layer):
    """Whether `layer` pools its window already: one of tfaccum's layers (a
    converted one carries Keras' name and module, not its bases')."""
    return any(cls.__module__.startswith("tfaccum.") for cls in type(layer).__mro__)


def _refuse_batch_norm_subclasses(model, batch_norm):
    subclasses = [
        f"{layer.name!r} ({type(layer).__name__})"
        for layer in _keras.flatten_layers(model)
        if isinstance(layer, batch_norm)
        and not _accumulates(layer)
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
