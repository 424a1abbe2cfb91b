"""`count_items()`: a custom loss or step says what its micro-batch's loss averaged over.

A count given as a Python or NumPy number is checked here, on every backend;
a tensor is checked by the backend whose step traces it. The step that
traces (TensorFlow's or JAX's) takes what it is told: a backend registers
how it listens (`register`), or collects the counts said while it traces
(`collected`); either refuses a second count in one step (`check_said_once`).
"""

import contextlib
import numbers
import threading

import numpy as np

_listening = threading.local()  # a list of counts, while a step collects them
_registered = []  # backends' own `count_items`, told in turn


def count_items(items):
    """Tells gradient accumulation what this micro-batch's loss is an average over.

    Call it inside a custom `train_step` or a custom loss, with the number of
    items (tokens, pixels, ...) the micro-batch's loss was divided by. The
    window then weights each micro-batch by it and divides by the window's
    total, as one large batch would: Hugging Face's `num_items_in_batch`.
    A micro-batch may count 0 items (every token masked): its loss must then
    be 0, as Keras makes it. Outside a step that an accumulation hook traces,
    it does nothing. It takes precedence over what tfaccum finds in Keras'
    compiled losses. Call it once per step.

    Args:
        items: A whole number >= 0 and at most 2**40 (a Python or NumPy
            number, or a scalar tensor, checked when the step runs): the
            count this micro-batch's loss was divided by. Under a
            `tf.distribute` strategy, this replica's count. On JAX it must
            depend on the data only (a count does), not on the weights.

    Returns:
        `items`, unchanged, so that it can wrap the divisor in place.

    Example:

    ```python
    class TokenMeanLoss(keras.losses.Loss):
        def call(self, y_true, y_pred):
            valid = ops.cast(y_true != -100, "float32")
            per_token = ops.sparse_categorical_crossentropy(
                ops.maximum(y_true, 0), y_pred) * valid
            items = tfaccum.count_items(ops.sum(valid))
            return ops.divide_no_nan(ops.sum(per_token), items)  # a token mean
    ```
    """
    if not is_tensor(items):
        check_number(items)
    counts = getattr(_listening, "counts", None)
    if counts is not None:
        counts.append(items)
        return items
    for told in _registered:
        told(items)
    return items


def register(count_items_of_backend):
    """Has `count_items` also tell a backend's own (TensorFlow's)."""
    if count_items_of_backend not in _registered:
        _registered.append(count_items_of_backend)


@contextlib.contextmanager
def collected():
    """Collects the counts said while a step traces in this thread (JAX's)."""
    _listening.counts = counts = []
    try:
        yield counts
    finally:
        _listening.counts = None


# The largest count a micro-batch may say it averaged over: its window's
# int64 total then holds 2**23 such micro-batches.
MAX_ITEMS = 2**40


def refuse(error, problem, items):
    """Raises `error` saying what `count_items()` takes (`problem`) and what it got."""
    raise error(
        f"`count_items()` takes what one micro-batch's loss was divided by: {problem}. "
        f"Received: items={items!r}"
    )


def is_tensor(items):
    """Whether `items` is a framework's tensor (not a Python or NumPy number)."""
    return (hasattr(items, "shape") and hasattr(items, "dtype")
            and not isinstance(items, (np.ndarray, np.generic)))


# What a count must be, checked on the host (`check_number`) or, for a tensor,
# in the step as it runs (each backend in its ops): (name, what it takes).
RUN_TIME_CHECKS = (
    ("finite", "a finite number"),
    ("non_negative", "a count >= 0"),
    ("whole", "a whole number"),
    ("at_most", f"at most {MAX_ITEMS} (2**40) items"),
)


def check_number(items):
    """Checks a Python or NumPy count (or a step's tensor read back as one) on the host."""
    if isinstance(items, (bool, np.bool_)) or not isinstance(items, numbers.Real):
        refuse(TypeError, "a whole number (a Python or NumPy number, or a scalar tensor)", items)
    value = float(items)
    # The texts of RUN_TIME_CHECKS, written out so that the refusals page finds them.
    if value != value or value in (float("inf"), float("-inf")):
        refuse(ValueError, "a finite number", items)
    if value < 0:
        refuse(ValueError, "a count >= 0", items)
    if value != int(value):
        refuse(ValueError, "a whole number", items)
    if int(items) > MAX_ITEMS:
        refuse(ValueError, f"at most {MAX_ITEMS} (2**40) items", items)


def check_traced(items, *, dtype_name, is_number, shape):
    """Checks a tensor count while its step traces: a number (`is_number`: its
    dtype is an integer or a float) and a scalar (`shape`, a tuple or `None`
    where unknown)."""
    if not is_number:
        refuse(TypeError, f"a number, not a tensor of {dtype_name}", items)
    if shape is not None and len(shape) != 0:
        refuse(ValueError, f"a scalar, not a tensor of shape {shape}", items)


def check_said_once(said):
    """Refuses a step that called `count_items()` more than once (`said`: the counts)."""
    if len(said) > 1:
        raise ValueError(
            f"`count_items()` was called {len(said)} times in one step; the window weights "
            "each micro-batch by one count. Call it once per step, with the total of what "
            f"the step's loss was divided by. Received: items={said!r}")
