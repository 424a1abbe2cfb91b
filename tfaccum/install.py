"""Accumulation installed by hand, on whichever backend the model runs."""

import warnings

from tfaccum import _keras
from tfaccum import backend as backends
from tfaccum.patching import installed_on


def install_accumulation_hook(model, *, accumulation_steps, reduction="auto", skip_nonfinite=None,
                              sparse_gradients="rows", accumulator_dtype="float32"):
    """Installs gradient accumulation on a compiled model and returns the hook.

    See `AccumulationHook` for the arguments; `hook.remove()` undoes it. The
    hook stays installed until removed, across any number of `fit` calls.
    The model's `AccumBatchNormalization` layers pool their windows.

    Returns:
        The installed `AccumulationHook` of the model's backend (its
        counters, `flush()`, `drop()`, `remove()`; a context manager that
        flushes and removes on exit).

    Example:

    ```python
    with tfaccum.install_accumulation_hook(model, accumulation_steps=4):
        model.fit(x, y, batch_size=8)  # updates once every 4 batches
    ```
    """
    _keras.api_for_model_argument(model, "model")
    return backends.for_model(model).install(
        model, accumulation_steps=accumulation_steps, reduction=reduction,
        skip_nonfinite=skip_nonfinite, sparse_gradients=sparse_gradients,
        accumulator_dtype=accumulator_dtype)


def remove_accumulation_hook(model):
    """Removes the accumulation hook from `model`, if one is installed.

    Returns:
        The removed `AccumulationHook`, or `None` if none was installed.
    """
    _keras.api_for_model_argument(model, "model")
    hook = installed_on(model)
    if hook is not None:
        hook.remove()
    return hook


def warn_if_discarded(pending):
    """Warns that removing a hook discards its `pending` window, if it holds any."""
    if pending.micro_batches:
        warnings.warn(
            f"Removing the accumulation hook discards {pending.micro_batches} "
            f"micro-batches ({pending.samples} samples) that were never "
            "applied. Call `hook.flush()` (or `hook.drop()`) before "
            "`hook.remove()` to decide what happens to them.",
            stacklevel=3,
        )
