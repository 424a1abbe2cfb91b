"""Accumulation installed by hand, on whichever backend the model runs."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from tfaccum import _keras
from tfaccum import backend as backends
from tfaccum.patching import installed_on

if TYPE_CHECKING:  # the hook imports this module
    from tfaccum.hook_front import HookFront as AccumulationHook


def install_accumulation_hook(model, *, accumulation_steps: int, reduction: str = "auto",
                              skip_nonfinite: bool | None = None, sparse_gradients: str = "rows",
                              accumulator_dtype: str = "float32") -> AccumulationHook:
    """Installs gradient accumulation on a compiled model and returns the hook.

    `hook.remove()` undoes it. The hook stays installed until removed, across
    any number of `fit` calls. The model's `AccumBatchNormalization` layers
    pool their windows.

    Args:
        model (keras.Model): A compiled Keras model.
        accumulation_steps: Micro-batches per optimizer update: an integer >= 1
            (`hook.set_accumulation_steps()` changes it).
        reduction: As `GradientAccumulationCallback`'s.
        skip_nonfinite: As `GradientAccumulationCallback`'s.
        sparse_gradients: As `GradientAccumulationCallback`'s.
        accumulator_dtype: As `GradientAccumulationCallback`'s.

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


def remove_accumulation_hook(model) -> AccumulationHook | None:
    """Removes the accumulation hook from `model`, if one is installed.

    Args:
        model (keras.Model): The model the hook was installed on.

    Returns:
        The removed `AccumulationHook`, or `None` if none was installed.

    Example:

    ```python
    hook = tfaccum.install_accumulation_hook(model, accumulation_steps=4)
    model.fit(x, y, batch_size=8)
    hook.flush()  # apply a partial last window
    tfaccum.remove_accumulation_hook(model)  # a plain Keras model again
    ```
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
