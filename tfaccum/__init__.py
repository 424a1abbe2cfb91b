"""tfaccum: exact, observable gradient accumulation for Keras."""

import importlib

__version__ = "0.1.0"

# Every public name is imported when first used: `import tfaccum` loads no
# framework (the dashboard plugin reads `tfaccum.dashboard_schema` inside
# TensorBoard without Keras), and a backend's names load only that backend.
_PUBLIC = {
    "GradientAccumulationCallback": "tfaccum.callback",
    "BackupAndRestore": "tfaccum.backup",
    "Window": "tfaccum.counts",
    "install_accumulation_hook": "tfaccum.install",
    "remove_accumulation_hook": "tfaccum.install",
    "count_items": "tfaccum.items",
    "Reduction": "tfaccum.reduction",
    "InBatchSoftmax": "tfaccum.window_losses",
    "NTXent": "tfaccum.window_losses",
    "WindowLoss": "tfaccum.window_losses",
    "convert_batch_norm": "tfaccum.batch_norm_conversion",
    "disable_keras3_multi_worker": "tfaccum.backend.tensorflow.multi_worker",
    "enable_keras3_multi_worker": "tfaccum.backend.tensorflow.multi_worker",
}

# Each backend's own, in its package: the hook, and the layer whose window it pools.
_PER_BACKEND = {
    "AccumulationHook": "hook",
    "AccumBatchNormalization": "batch_norm",
}

__all__ = sorted([*_PER_BACKEND, *_PUBLIC])


def __getattr__(name):
    if name in _PER_BACKEND:  # the backend Keras runs on has its own
        import keras

        module = f"tfaccum.backend.{keras.backend.backend()}.{_PER_BACKEND[name]}"
    elif name in _PUBLIC:
        module = _PUBLIC[name]
    else:
        raise AttributeError(f"module 'tfaccum' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        if error.name == module:  # a backend that has no such part yet
            import keras

            raise ImportError(
                f"tfaccum.{name} is not served on Keras' {keras.backend.backend()!r} backend "
                "yet: train with KERAS_BACKEND=tensorflow or jax, where it is "
                "(docs/torch.md).") from error
        if error.name != "tensorflow":
            raise
        raise ImportError(
            f"tfaccum.{name} is TensorFlow code, and TensorFlow is not installed here. "
            "Install it with `pip install \".[tensorflow]\"` and set KERAS_BACKEND=tensorflow, "
            "or leave it out: on Keras' JAX backend it is not served yet "
            "(docs/jax.md).") from error
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
