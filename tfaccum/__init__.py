"""tfaccum: exact, observable gradient accumulation for Keras."""

import importlib

from tfaccum.callback import GradientAccumulationCallback  # noqa: F401
from tfaccum.counts import Window  # noqa: F401
from tfaccum.install import install_accumulation_hook  # noqa: F401
from tfaccum.install import remove_accumulation_hook  # noqa: F401
from tfaccum.items import count_items  # noqa: F401
from tfaccum.reduction import Reduction  # noqa: F401

__version__ = "0.1.0"

# Names a backend provides, imported when first used, so that `import
# tfaccum` loads no framework the model does not run on.
_FROM_BACKEND = {
    "AccumBatchNormalization": "tfaccum.backend.tensorflow.layers",
    "InBatchSoftmax": "tfaccum.backend.tensorflow.window_loss",
    "NTXent": "tfaccum.backend.tensorflow.window_loss",
    "WindowLoss": "tfaccum.backend.tensorflow.window_loss",
    "convert_batch_norm": "tfaccum.backend.tensorflow.convert",
    "disable_keras3_multi_worker": "tfaccum.backend.tensorflow.multi_worker",
    "enable_keras3_multi_worker": "tfaccum.backend.tensorflow.multi_worker",
}

__all__ = sorted([
    "AccumulationHook", "GradientAccumulationCallback", "Reduction", "Window",
    "count_items", "install_accumulation_hook", "remove_accumulation_hook", *_FROM_BACKEND])


def __getattr__(name):
    if name == "AccumulationHook":  # the hook of the backend Keras runs on
        import keras

        module = f"tfaccum.backend.{keras.backend.backend()}.hook"
    elif name in _FROM_BACKEND:
        module = _FROM_BACKEND[name]
    else:
        raise AttributeError(f"module 'tfaccum' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
