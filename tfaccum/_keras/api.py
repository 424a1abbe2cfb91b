"""Which Keras a model belongs to, and whether tfaccum serves its backend.

`api_for(model)` gives `keras3.Keras3` or `tf_keras.TfKeras`: the one object
that knows how the model's Keras does what differs.
"""

import os
import sys

import keras

from tfaccum._keras.keras3 import Keras3
from tfaccum._keras.models import is_model
from tfaccum._keras.models import is_tf_keras_model


SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")


def check_backend(model=None):
    """Raises unless Keras 3 runs on a backend tfaccum serves (public: `keras.backend.backend()`).

    Without a `model` (a callback made before `fit`), a user of tf_keras,
    which runs on TensorFlow whatever Keras 3's backend, is not refused.
    """
    backend = keras.backend.backend() if model is None else api_for(model).backend()
    if backend in SUPPORTED_BACKENDS or (model is None and "tf_keras" in sys.modules):
        return
    raise ValueError(
        f"tfaccum accumulates gradients on Keras 3's TensorFlow, JAX and PyTorch backends (and on "
        f"tf_keras), but Keras is running on its {backend!r} backend, which tfaccum does "
        f"not support yet. Received: keras.backend.backend()={backend!r} "
        f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND=tensorflow, "
        "jax or torch before Keras is first imported.")


def api_for_model_argument(value, argument):
    """`api_for(value)`, or a clear error naming `argument` if it is no model
    or runs on a Keras backend tfaccum does not serve."""
    if not is_model(value):
        raise TypeError(
            f"`{argument}` must be a compiled Keras model (keras.Model or "
            f"tf_keras.Model). Received: {argument}={value!r} (of type "
            f"{type(value).__name__})"
        )
    check_backend(value)
    return api_for(value)


def api_for(model):
    """`Keras3` or `TfKeras`: what `model` was built with."""
    if is_tf_keras_model(model):
        # tf_keras runs on TensorFlow only: its side lives with that backend.
        from tfaccum.backend.tensorflow._keras_on_tf.tf_keras import TfKeras

        return TfKeras
    return Keras3
