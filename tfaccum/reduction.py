"""How a window weighs its micro-batches, and what it divides their sum by.

`reduction=` takes one of the names below or a `Reduction` instance: the
window adds each micro-batch's gradient times `weight()` and applies the sum
divided by `denominator()`. Everything else (replicas, loss scaling, the
outputs that count differently) is the window's business, not the reduction's.
"""

from keras import ops

from tfaccum import _keras


class Reduction:
    """Base class of a window's reduction. Subclass it for a weighting of your own.

    Override `weight()` and `denominator()`; both run inside the compiled
    train step, on tensors (write them with `keras.ops` or operators: they
    then serve every backend). With several replicas a replica's share of a
    micro-batch is weighted like a micro-batch (its own samples and items),
    and `denominator()` receives the window's counts over all replicas.

    Attributes:
        name: How it shows in `repr` and `get_config`.
        counts_items: Whether the window asks the step's compiled losses (and
            `count_items()`) what each micro-batch's loss averages over. If
            not, `items` is the micro-batch's samples.
        per_micro_batch: Whether every micro-batch (every replica's share)
            weighs the same whatever it holds, so that a window's gradient is
            a mean over micro-batches: such a reduction cannot leave out one
            replica's share (`skip_nonfinite` on several replicas).
        weighs_items: Whether `weight()` is `items` whenever every micro-batch
            with a sample counts an item (a loss over a fixed number of
            elements per sample): the step then takes `items` without calling it.

    Example:

    ```python
    class EqualMicroBatches(tfaccum.Reduction):
        \"\"\"Each micro-batch weighs the same (as reduction="mean").\"\"\"

        name = "equal micro-batches"
        per_micro_batch = True

        def denominator(self, window):
            return window["window_micro_batches"] - window["window_nonfinite"]

    callback = tfaccum.GradientAccumulationCallback(
        accumulation_steps=4, reduction=EqualMicroBatches())
    ```
    """

    name = "custom"
    counts_items = False
    per_micro_batch = False
    weighs_items = False

    def weight(self, samples, items, open_window):
        """A micro-batch's weight in its window, or `None` to add it as it is.

        Args:
            samples: The micro-batch's samples (int64 scalar tensor).
            items: What its loss averages over (int64): its samples, or its
                unmasked tokens where `counts_items`.
            open_window: `{count name: int64 tensor}` of this replica's open
                window before this micro-batch (`window_micro_batches`,
                `window_samples`, `window_items`, `window_nonfinite`).
        """
        return None

    def denominator(self, window):
        """What the window's summed gradient is divided by, or `None` for nothing.

        Args:
            window: `{count name: int64 tensor}` of the window being applied,
                over all replicas (`window_micro_batches` counts micro-batches,
                the others replicas' shares summed).
        """
        return None

    def keeps(self, local, window):
        """Whether this replica's share of the window joins it (a bool tensor, or `True`)."""
        return True

    def check(self, model):
        """Raises if `model` cannot be accumulated exactly with this reduction.

        Called when the hook is installed and when its step traces.
        """

    def get_config(self):
        return self.name

    def __repr__(self):
        return repr(self.name) if isinstance(self, _BUILT_IN) else f"{type(self).__name__}()"

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


class Auto(Reduction):
    """Each micro-batch weighs what its loss averages over: samples, or unmasked items.

    A micro-batch that counts nothing (every token masked: Keras makes its
    loss 0) weighs nothing in a window that counts something. While its window
    has counted nothing it weighs its samples, so that a window of nothing but
    such micro-batches applies their mean gradient (the regularisers', or
    zero) as the large batch does; the first micro-batch that counts empties
    what they added (`WindowState`), and a replica whose share counted nothing
    in a window that did adds nothing (`keeps`).
    """

    name = "auto"
    counts_items = True
    weighs_items = True

    def weight(self, samples, items, open_window):
        return ops.where(items > 0, items,
                         ops.where(open_window["window_items"] > 0, ops.zeros_like(samples), samples))

    def denominator(self, window):
        return counted_or_samples(window)

    def keeps(self, local, window):
        return ops.logical_or(local["window_items"] > 0, window["window_items"] <= 0)


class Samples(Reduction):
    """Each micro-batch weighs its samples (exact for losses averaged per sample)."""

    name = "samples"
    weighs_items = True  # it counts no item: `items` are the samples

    def weight(self, samples, items, open_window):
        return samples

    def denominator(self, window):
        return window["window_samples"]


class Mean(Reduction):
    """Each micro-batch weighs the same (Keras' built-in accumulation)."""

    name = "mean"
    per_micro_batch = True

    def denominator(self, window):
        return window["window_micro_batches"] - window["window_nonfinite"]


class Sum(Reduction):
    """The micro-batches' gradients added, not divided (for losses reduced with "sum")."""

    name = "sum"

    def check(self, model):
        regularized = _keras.api_for(model).regularized_weights(model)
        if regularized:
            raise ValueError(
                "reduction='sum' adds the micro-batches' gradients, each with the "
                "gradient of the model's weight regularizers: a window of N "
                "micro-batches would apply them N times, where the large batch "
                "applies them once. Received: reduction='sum' with regularized "
                f"weights {regularized}. Use a loss averaged per sample with "
                "reduction='auto', or drop the weight regularizers."
            )


_BUILT_IN = (Auto, Samples, Mean, Sum)
BY_NAME = {cls.name: cls for cls in _BUILT_IN}


def counted_or_samples(window):
    """The window's items, or its samples where it counted no item."""
    return ops.where(window["window_items"] > 0, window["window_items"], window["window_samples"])


def get(reduction):
    """A `Reduction` from a name (`"auto"`, `"samples"`, `"mean"`, `"sum"`) or an instance."""
    if isinstance(reduction, Reduction):
        return reduction
    return BY_NAME[reduction]()
