"""The dashboard's schema: what the writer (`tfaccum.dashboard_writer`) and the plugin agree on.

One place for the plugin name, the content proto's version, the tags, the
`SummaryMetadata` that marks each series, and the vocabulary the callback,
the plugin's JSON and the dashboard's JavaScript share: the leftover
policies and the batch-size advisor's rule. Python defines them here, the
`runs` route carries them (`VOCABULARY`), the page reads them from there.
"""

import math

from google.protobuf import message
from tensorboard.compat.proto import summary_pb2

from tfaccum import accumulation_pb2

PLUGIN_NAME = "accumulation"
PROTO_VERSION = 1
# Points kept per series unless `--samples_per_plugin=accumulation=N` says
# otherwise (0 keeps all), as TensorBoard keeps for scalars.
DEFAULT_SAMPLES = 1000

Kind = accumulation_pb2.AccumulationPluginData
PluginData = accumulation_pb2.AccumulationPluginData

TAG_PREFIX = "accumulation/"
ACCUMULATOR_PREFIX = TAG_PREFIX + "accumulator_norm/"

# Series written once per optimizer update, in this order, with their kind.
UPDATE_SERIES = (
    ("applied_gradient_norm", Kind.APPLIED_GRADIENT_NORM),
    ("micro_norm_mean", Kind.MICRO_NORM_MEAN),
    ("micro_norm_max", Kind.MICRO_NORM_MAX),
    ("window_micro_batches", Kind.WINDOW_MICRO_BATCHES),
    ("window_samples", Kind.WINDOW_SAMPLES),
    ("micro_steps", Kind.MICRO_STEPS),
    ("skipped_updates", Kind.SKIPPED_UPDATES),
    ("nonfinite_skips", Kind.NONFINITE_SKIPS),
    ("noise_scale", Kind.NOISE_SCALE),
    ("window_items", Kind.WINDOW_ITEMS),
    ("window_loss", Kind.WINDOW_LOSS),
)
# Series written once per leftover event.
LEFTOVER_SERIES = (
    ("leftover/policy", Kind.LEFTOVER_POLICY),
    ("leftover/micro_batches", Kind.LEFTOVER_MICRO_BATCHES),
    ("leftover/samples", Kind.LEFTOVER_SAMPLES),
)
# What happens to a window that is not full at an epoch's end; a leftover
# event stores the policy's index in this tuple.
LEFTOVER_POLICIES = ("flush", "carry", "drop")
LEFTOVER_LABELS = {
    "flush": "flush (applied)",
    "carry": "carry (kept for next epoch)",
    "drop": "drop (discarded)",
}
# The batch-size advisor: an effective batch more than ADVICE_BAND times
# B_simple means "accumulate less", less than B_simple / ADVICE_BAND "more".
ADVICE_BAND = 2.0


def leftover_points(policy, window, micro_steps, updates, nonfinite):
    """`(series name, kind, value)` of one leftover event and the counters then.

    Args:
        policy: One of `LEFTOVER_POLICIES`.
        window: `(micro_batches, samples)` flushed, carried or dropped.
        micro_steps, updates, nonfinite: Counted so far in this fit;
            micro-steps after the last update (dropped or carried) count too.
    """
    points = [(name, kind, value) for (name, kind), value in zip(
        LEFTOVER_SERIES, (LEFTOVER_POLICIES.index(policy), *window))]
    return points + [
        ("micro_steps", Kind.MICRO_STEPS, micro_steps),
        ("skipped_updates", Kind.SKIPPED_UPDATES, micro_steps - updates),
        ("nonfinite_skips", Kind.NONFINITE_SKIPS, nonfinite),
    ]


def suggested_accumulation_steps(noise_scale, micro_batch):
    """The `accumulation_steps` whose effective batch is closest to B_simple.

    `max(1, round(noise_scale / micro_batch))`, rounding halves up (as
    JavaScript's `Math.round` does for positive numbers). `None` when either
    is not a positive number.
    """
    if not (noise_scale and micro_batch and noise_scale > 0 and micro_batch > 0):
        return None
    if not math.isfinite(noise_scale / micro_batch):
        return None
    return max(1, math.floor(noise_scale / micro_batch + 0.5))


def batch_advice(batch, noise_scale):
    """`"less"`, `"more"` or `"good"`: the effective `batch` against B_simple."""
    if batch > ADVICE_BAND * noise_scale:
        return "less"
    if batch < noise_scale / ADVICE_BAND:
        return "more"
    return "good"


def run_advice(steps, noise, items, samples, micro_batches, flushed_steps):
    """The batch-size advisor's verdict for one run, as the dashboard shows it.

    B_simple: the run's last usable estimate (finite and positive). B: the
    effective batch (`items`, or `samples` where the run counted no item) of
    the run's last update, leaving out an update that flushed a partial
    window (unless every update did): its window is shorter than the run's
    accumulation_steps says. The micro-batch is B / micro-batches there, the
    suggestion the accumulation_steps that makes B closest to B_simple, the
    verdict `batch_advice`'s.

    Args:
        steps, noise, items, samples, micro_batches: One run's series (lists
            of floats or `None`), aligned on `steps`.
        flushed_steps: Steps of the run's flush events.

    Returns:
        `{advice: "less" | "more" | "good" | "unknown", suggested_steps,
        noise_scale, batch, micro_batch, accumulation, step, last_step}`
        (numbers or `None`).
    """
    def usable(value):
        return value is not None and math.isfinite(value) and value > 0

    noise_scale = next((v for v in reversed(noise) if usable(v)), None)
    batch = items if any(usable(v) for v in items) else samples
    flushed = set(flushed_steps)
    at = last = -1
    for i in range(len(steps) - 1, -1, -1):
        if not usable(batch[i]) or not usable(micro_batches[i]):
            continue
        if last < 0:
            last = i
        if steps[i] not in flushed:
            at = i
            break
    if at < 0:
        at = last
    result = {"advice": "unknown", "suggested_steps": None, "noise_scale": noise_scale,
              "batch": None, "micro_batch": None, "accumulation": None, "step": None,
              "last_step": steps[-1] if steps else None}
    if at < 0:
        return result
    micro_batch = batch[at] / micro_batches[at]
    result.update(batch=batch[at], micro_batch=micro_batch, accumulation=micro_batches[at],
                  step=steps[at])
    if noise_scale is None:
        return result
    result["suggested_steps"] = suggested_accumulation_steps(noise_scale, micro_batch)
    result["advice"] = batch_advice(batch[at], noise_scale)
    return result


# Carried by the `runs` route for the dashboard.
VOCABULARY = {
    "leftover_policies": list(LEFTOVER_POLICIES),
    "leftover_labels": LEFTOVER_LABELS,
    "advice_band": ADVICE_BAND,
}

_DESCRIPTIONS = {
    Kind.APPLIED_GRADIENT_NORM: "Global L2 norm of the gradient applied at each optimizer update.",
    Kind.ACCUMULATOR_NORM: "L2 norm of this variable's applied (accumulated, normalised) gradient.",
    Kind.MICRO_NORM_MEAN: "Mean gradient norm of the micro-batches in the window.",
    Kind.MICRO_NORM_MAX: "Largest gradient norm among the micro-batches in the window.",
    Kind.WINDOW_MICRO_BATCHES: "Micro-batches the applied window held.",
    Kind.WINDOW_SAMPLES: "Samples the applied window held.",
    Kind.MICRO_STEPS: "Micro-steps trained so far in this fit.",
    Kind.SKIPPED_UPDATES: "Micro-steps so far in this fit that did not update the optimizer.",
    Kind.NONFINITE_SKIPS: "Micro-batches so far left out of their window for non-finite gradients.",
    Kind.NOISE_SCALE: "Gradient noise scale B_simple (McCandlish et al. 2018), smoothed.",
    Kind.WINDOW_ITEMS: "What the window's losses averaged over: its samples, or its unmasked tokens.",
    Kind.WINDOW_LOSS: "The window's loss, weighted as its gradient: the loss the large batch reports.",
    Kind.LEFTOVER_POLICY: "Partial window at an epoch's or fit's end: "
    + ", ".join(f"{i} {policy}" for i, policy in enumerate(LEFTOVER_POLICIES))
    + ".",
    Kind.LEFTOVER_MICRO_BATCHES: "Micro-batches the partial window held.",
    Kind.LEFTOVER_SAMPLES: "Samples the partial window held.",
}


def create_summary_metadata(kind, variable=""):
    """A scalar `SummaryMetadata` for one accumulation series.

    Args:
        kind: An `AccumulationPluginData.Kind` value.
        variable: For `ACCUMULATOR_NORM`, the variable's path.
    """
    content = PluginData(version=PROTO_VERSION, kind=kind, variable=variable)
    return summary_pb2.SummaryMetadata(
        summary_description=_DESCRIPTIONS[kind],
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=content.SerializeToString()
        ),
        data_class=summary_pb2.DATA_CLASS_SCALAR,
    )


def parse_plugin_metadata(content):
    """Parses `plugin_data.content`; `None` if it is from a newer writer.

    Args:
        content: The `bytes` of `SummaryMetadata.plugin_data.content`.

    Raises:
        ValueError: if `content` is not an `AccumulationPluginData` proto.
    """
    try:
        data = PluginData.FromString(content)
    except message.DecodeError as error:
        raise ValueError(f"its plugin metadata cannot be decoded ({error})") from None
    if data.version > PROTO_VERSION:
        return None
    return data
