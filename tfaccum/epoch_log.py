"""What the callback prints with `verbose=1`: each epoch's micro-steps, updates and leftover."""

_PAST = {"flush": "flushed", "carry": "carried", "drop": "dropped"}


def epoch_line(epoch, counts, accumulation_steps, leftover, window, noise_scale=None,
               suggested_steps=None):
    """`Epoch 3: 8 micro-steps, 2 optimizer updates (accumulation_steps=4); ...`.

    Args:
        epoch: The epoch (0-based).
        counts: The epoch's counters, `{name: int}`.
        accumulation_steps: The window length of the epoch.
        leftover: The leftover policy (`"flush"`, `"carry"`, `"drop"`).
        window: The `Window` left at the epoch's end.
        noise_scale, suggested_steps: The noise scale estimate, if any.
    """
    items = f" ({counts['items']} items)" if counts["items"] != counts["samples"] else ""
    left = (f"{_PAST[leftover]} {describe(window)}" if window.micro_batches
            else "no partial window")
    noise = ("" if noise_scale is None else f"; noise scale B_simple={noise_scale:.4g} "
             f"(suggests accumulation_steps={suggested_steps})")
    return (f"Epoch {epoch + 1}: {counted(counts['micro_steps'], 'micro-step')}{items}, "
            f"{counted(counts['optimizer_steps'], 'optimizer update')} "
            f"(accumulation_steps={accumulation_steps}); {left}{noise}.")


def fit_end_line(action, window):
    """What was done with the window left when `fit` ended (`action`: flush or drop)."""
    return f"GradientAccumulationCallback: {_PAST[action]} {describe(window)} when fit ended."


def long_window_warning(accumulation_steps, epoch_steps, leftover):
    """What a window longer than an epoch does under `leftover`."""
    what = {
        "flush": (f"each epoch flushes its window early, as one update of {epoch_steps} "
                  "micro-batches (a smaller batch than asked for). Pass leftover=\"carry\" "
                  "to let windows span epochs, or lower accumulation_steps"),
        "carry": (f"each window spans epochs: one update about every "
                  f"{accumulation_steps / epoch_steps:.3g} epochs"),
        "drop": ("every epoch's micro-batches are dropped and the model never updates. "
                 "Pass leftover=\"carry\" to let windows span epochs, or lower "
                 "accumulation_steps"),
    }[leftover]
    return (f"accumulation_steps={accumulation_steps} is longer than an epoch of "
            f"{counted(epoch_steps, 'micro-batch')}: with leftover={leftover!r}, {what}.")


def describe(window):
    """`a partial window of 2 micro-batches (16 samples)`."""
    return (f"a partial window of {counted(window.micro_batches, 'micro-batch')} "
            f"({counted(window.samples, 'sample')})")


def counted(count, noun):
    """`1 micro-step`, `2 micro-steps`."""
    plural = "es" if noun.endswith("ch") else "s"
    return f"{count} {noun}{'' if count == 1 else plural}"
