"""The hook's counts: their names, and the counters a user reads.

The `window_*` counts describe the open window and go back to zero when it
ends; the others count since the hook was installed. A backend stores them
(TensorFlow's: a variable, `tfaccum.backend.tensorflow.counter_variable`;
where the host decides where windows end: `HostCounts`); `Counters` is one
read of them on the host.
"""

import dataclasses
import typing


class Window(typing.NamedTuple):
    """What an accumulation window held (a tuple: `micro_batches, samples`).

    Attributes:
        micro_batches: The micro-batches summed into it.
        samples: Their samples, over every replica and device.

    Example:

    ```python
    window = hook.flush()  # Window(micro_batches=3, samples=24)
    if window.micro_batches:
        print(f"applied {window.samples} samples")
    ```
    """

    micro_batches: int
    samples: int

# The counts a hook keeps. The `window_*` ones describe the open window and
# go back to zero when it ends; the others count since the hook was installed.
# `window_items`: what the window's gradient is divided by under
# reduction="auto": its samples, or the unmasked elements its losses averaged.
WINDOW_COUNTS = (
    "window_micro_batches",
    "window_samples",
    "window_items",
    "window_nonfinite",
)
TOTAL_COUNTS = (
    "samples",
    "items",
    "micro_steps",
    "optimizer_steps",
    "flushes",
    "dropped_micro_steps",
    "nonfinite_skips",
)
# With several replicas every replica keeps every count (the same on each),
# except the open window's samples, items and shares left out (non-finite):
# each replica's own, summed when the window is reduced at its end. Their
# totals are then added from the reduced window, so every count reads locally.
REPLICA_SHARES = ("window_samples", "window_items", "window_nonfinite")


@dataclasses.dataclass(frozen=True)
class Counters:
    """A hook's counters at one moment: one read from the device serves them all.

    Integers counted since the hook was installed (for the callback: over the
    last `fit`).

    Attributes:
        micro_steps: Micro-batches trained on.
        optimizer_steps: Optimizer updates made.
        flushes: Partial windows applied by `flush()` (at an epoch's or
            `fit`'s end).
        dropped_micro_steps: Micro-batches discarded by `drop()`
            (`leftover="drop"`).
        nonfinite_skips: Micro-batches left out for non-finite gradients.
        samples: Samples whose gradients joined a window.
        items: What their losses averaged over: equal to `samples`, or the
            unmasked elements (tokens) where masks or `ignore_class` reach the
            loss; windows are weighted in this unit (`reduction="auto"`).
    """

    micro_steps: int = 0
    optimizer_steps: int = 0
    flushes: int = 0
    dropped_micro_steps: int = 0
    nonfinite_skips: int = 0
    samples: int = 0
    items: int = 0

    @classmethod
    def read(cls, counts):
        """The counters of `counts` (a backend's store of them), read once."""
        values = counts.numpy()
        return cls(**{field.name: values[field.name] for field in dataclasses.fields(cls)})


# What a backend whose host ends windows counts on the device: what only the
# data tells (a micro-batch's items; whether its gradient was finite), so
# that no micro-step waits for the device. The `*_left_out` ones correct the
# host's counts: the samples of micro-batches left out (non-finite), and the
# windows that held nothing else (no update was made).
DEVICE_COUNTS = (
    "window_items",
    "items",
    "window_nonfinite",
    "nonfinite_skips",
    "window_samples_left_out",
    "samples_left_out",
    "windows_left_out",
)


class HostCounts:
    """The counts of a backend whose host decides where windows end: host
    integers, but for what the data decides (`DEVICE_COUNTS`), which the
    compiled step counts on the device (`on_device`: a vector in that order)
    and a read fetches.

    Args:
        devices: The backend's devices: `zeros(shape, dtype)` makes the
            device-side vector (one per device under data parallelism) and
            `read(array)` sums it on the host.
    """

    def __init__(self, devices):
        self.devices = devices
        self.values = dict.fromkeys(WINDOW_COUNTS + TOTAL_COUNTS, 0)
        self.zero()

    def numpy(self):
        """The counts now, as `{name: int}` (one device read)."""
        device = dict(zip(DEVICE_COUNTS, (int(v) for v in self.devices.read(self.on_device))))
        values = dict(self.values)
        for name in ("window_items", "items", "window_nonfinite", "nonfinite_skips"):
            values[name] = device[name]
        values["window_samples"] -= device["window_samples_left_out"]
        values["samples"] -= device["samples_left_out"]
        values["optimizer_steps"] -= device["windows_left_out"]
        return values

    def unread(self, ops):
        """The counts now, as device scalars (`ops`: the backend's array namespace)
        where the device corrects the host's (what was left out), without a read."""
        device = dict(zip(DEVICE_COUNTS, ops.reshape(self.on_device,
                                                     (-1, len(DEVICE_COUNTS))).sum(axis=0)))
        values = dict(self.values)
        values["nonfinite_skips"] = device["nonfinite_skips"]
        values["optimizer_steps"] = values["optimizer_steps"] - device["windows_left_out"]
        return values

    def window_values(self):
        """The open window's host counts, in `WINDOW_COUNTS`' order (the step
        takes `window_items`, `window_nonfinite` and the samples left out from
        the device's)."""
        return [self.values[name] for name in WINDOW_COUNTS]

    def add(self, **counts):
        for name, value in counts.items():
            self.values[name] += value

    def clear_window(self):
        """Zeroes the window's counts on the host (a window was applied, flushed
        or dropped; the step zeroes the device's)."""
        for name in WINDOW_COUNTS:
            self.values[name] = 0

    def zero(self):
        for name in self.values:
            self.values[name] = 0
        self.on_device = self.devices.zeros((len(DEVICE_COUNTS),), "int32")


# The device's counts of the open window: emptied where a window ends or is dropped.
DEVICE_WINDOW_COUNTS = ("window_items", "window_nonfinite", "window_samples_left_out")


def device_index(name):
    """Where `name` is in the device's vector of counts (`DEVICE_COUNTS`)."""
    return DEVICE_COUNTS.index(name)


def with_counter_properties(cls):
    """Class decorator: a read-only property per `Counters` field, read from the
    class's `counters` snapshot (`hook.micro_steps` is `hook.counters.micro_steps`)."""
    for field in dataclasses.fields(Counters):
        setattr(cls, field.name, property(
            lambda self, name=field.name: getattr(self.counters, name),
            doc=f"`counters.{field.name}` (see `tfaccum.counts.Counters`)."))
    return cls
