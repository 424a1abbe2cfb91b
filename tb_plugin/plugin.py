"""The "Accumulation" TensorBoard plugin: JSON routes and the ES-module page.

Every route is a thin HTTP wrapper around a plain `*_impl` function that reads
through `context.data_provider` only (see `http_api.md`).
"""

import importlib.resources
import json
import math

from tensorboard import context
from tensorboard import errors
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_plugin import metadata

DEFAULT_POINTS = 1000  # points per chart line sent to the page
DEFAULT_COLUMNS = 120  # heat map columns sent to the page
MAX_POINTS = 100_000
READ_FACTOR = 4  # points read from the data provider per point drawn
_ALL = 2**62  # `--samples_per_plugin=accumulation=0`: everything kept
_APPLIED = metadata.TAG_PREFIX + "applied_gradient_norm"
_STATIC = ("index.js", "model.js", "views.js", "charts.js")


class AccumulationPlugin(base_plugin.TBPlugin):
    """Serves the Accumulation dashboard."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context):
        self._data_provider = context.data_provider
        hint = (context.sampling_hints or {}).get(self.plugin_name)
        self._downsample_to = _ALL if hint == 0 else (hint or metadata.DEFAULT_SAMPLES)

    def get_plugin_apps(self):
        apps = {"/runs": self._serve_runs, "/series": self._serve_series,
                "/events": self._serve_events}
        for name in _STATIC:
            apps["/" + name] = self._serve_static
        return apps

    def is_active(self):
        return False  # TensorBoard asks the data provider which plugins have data

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(
            es_module_path="/index.js", tab_name="Accumulation"
        )

    # -- HTTP wrappers ------------------------------------------------------------

    @wrappers.Request.application
    def _serve_static(self, request):
        name = request.path.rsplit("/", 1)[-1]
        try:
            body = importlib.resources.files("tb_plugin").joinpath("static", name).read_bytes()
        except FileNotFoundError:
            raise errors.NotFoundError(f"No file {name!r} in tb_plugin/static") from None
        return http_util.Respond(request, body, "text/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request):
        ctx, experiment = _context(request)
        return _json(request, self.runs_impl(ctx, experiment))

    @wrappers.Request.application
    def _serve_series(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        points = _positive_int(request, "points", DEFAULT_POINTS)
        columns = _positive_int(request, "columns", DEFAULT_COLUMNS)
        return _json(request, self.series_impl(ctx, experiment, run, points, columns))

    @wrappers.Request.application
    def _serve_events(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        return _json(request, self.events_impl(ctx, experiment, run))

    # -- plain functions ------------------------------------------------------------

    def _list(self, ctx, experiment, run=None):
        """{run: {tag: (PluginData, ScalarTimeSeries)}} for readable series."""
        run_filter = None if run is None else provider.RunTagFilter(runs=[run])
        listing = self._data_provider.list_scalars(
            ctx, experiment_id=experiment, plugin_name=self.plugin_name,
            run_tag_filter=run_filter,
        )
        result = {}
        for run_name, tags in listing.items():
            for tag, series in tags.items():
                data = metadata.parse_plugin_metadata(series.plugin_content)
                if data is not None:
                    result.setdefault(run_name, {})[tag] = (data, series)
        return result

    def _read(self, ctx, experiment, run, tags, downsample):
        data = self._data_provider.read_scalars(
            ctx, experiment_id=experiment, plugin_name=self.plugin_name,
            downsample=downsample,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(tags)),
        )
        return data.get(run, {})

    def _run_tags(self, ctx, experiment, run):
        tags = self._list(ctx, experiment, run).get(run)
        if not tags:
            raise errors.NotFoundError(f"No accumulation data for run {run!r}")
        return tags

    def runs_impl(self, ctx, experiment):
        """Runs with accumulation data, sorted by name."""
        runs = []
        for run, tags in sorted(self._list(ctx, experiment).items()):
            applied = tags.get(_APPLIED)
            runs.append({
                "run": run,
                "updates": applied[1].max_step if applied else 0,
                "variables": sum(
                    1 for data, _ in tags.values()
                    if data.kind == metadata.Kind.ACCUMULATOR_NORM
                ),
            })
        return {"runs": runs, "vocabulary": metadata.VOCABULARY}

    def series_impl(self, ctx, experiment, run, points=DEFAULT_POINTS,
                    columns=DEFAULT_COLUMNS):
        """Per-update series of one run, downsampled for drawing."""
        tags = self._run_tags(ctx, experiment, run)
        update_tags = [metadata.TAG_PREFIX + name for name, _ in metadata.UPDATE_SERIES]
        # Read a bounded sample of what TensorBoard keeps, then pick the
        # extremes of it: long runs stay fast, spikes stay visible. Series
        # written together have the same steps, so the provider's
        # deterministic sampling keeps them aligned.
        read = min(self._downsample_to, READ_FACTOR * points)
        data = self._read(ctx, experiment, run, [t for t in update_tags if t in tags], read)
        applied = data.get(_APPLIED, [])
        keep = downsample_min_max([d.value for d in applied], points)
        steps = [applied[i].step for i in keep]
        series = {}
        for name, _ in metadata.UPDATE_SERIES:
            by_step = {d.step: d.value for d in data.get(metadata.TAG_PREFIX + name, [])}
            series[name] = [_finite_or_text(by_step.get(step)) for step in steps]
        variables = sorted(
            (d.variable, tag) for tag, (d, _) in tags.items()
            if d.kind == metadata.Kind.ACCUMULATOR_NORM
        )
        norms = self._read(ctx, experiment, run, [tag for _, tag in variables],
                           min(self._downsample_to, READ_FACTOR * columns))
        heat = heat_map([norms.get(tag, []) for _, tag in variables], columns)
        return {
            "run": run,
            "sampled": len(applied),
            "steps": steps,
            "series": series,
            "accumulators": {
                "variables": [name for name, _ in variables],
                "columns": heat["columns"],
                "values": heat["values"],
            },
        }

    def events_impl(self, ctx, experiment, run):
        """Leftover events and the latest counters of one run."""
        tags = self._run_tags(ctx, experiment, run)
        names = [metadata.TAG_PREFIX + name for name, _ in metadata.LEFTOVER_SERIES]
        data = self._read(ctx, experiment, run, [t for t in names if t in tags], _ALL)
        columns = [{d.step: d.value for d in data.get(tag, [])} for tag in names]
        events = []
        for step in sorted(columns[0]):
            policy, micro_batches, samples = (int(c.get(step, 0)) for c in columns)
            events.append({
                "step": step,
                "policy": metadata.LEFTOVER_POLICIES[policy],
                "micro_batches": micro_batches,
                "samples": samples,
            })
        last = self._data_provider.read_last_scalars(
            ctx, experiment_id=experiment, plugin_name=self.plugin_name,
            run_tag_filter=provider.RunTagFilter(runs=[run]),
        ).get(run, {})

        def last_value(name):
            datum = last.get(metadata.TAG_PREFIX + name)
            return None if datum is None else int(datum.value)

        applied = last.get(_APPLIED)
        return {
            "run": run,
            "events": events,
            "counters": {
                "optimizer_steps": None if applied is None else applied.step,
                "micro_steps": last_value("micro_steps"),
                "skipped_updates": last_value("skipped_updates"),
                "nonfinite_skips": last_value("nonfinite_skips"),
                "flushes": sum(e["policy"] == "flush" for e in events),
                "carries": sum(e["policy"] == "carry" for e in events),
                "dropped_micro_steps": sum(
                    e["micro_batches"] for e in events if e["policy"] == "drop"
                ),
            },
        }


# -- downsampling ------------------------------------------------------------------


def downsample_min_max(values, points):
    """Indices of at most `points` values that keep each bucket's extremes.

    Non-finite values are always kept: they are what a reader looks for.
    The first and last values are always kept.
    """
    n = len(values)
    if n <= points:
        return list(range(n))
    buckets = max(1, (points - 2) // 2)
    keep = {0, n - 1}
    size = (n - 2) / buckets
    for b in range(buckets):
        start, end = 1 + int(b * size), 1 + int((b + 1) * size)
        if start >= end:
            continue
        chunk = range(start, end)
        finite = [i for i in chunk if math.isfinite(values[i])]
        keep.update(i for i in chunk if not math.isfinite(values[i]))
        if finite:
            keep.add(min(finite, key=values.__getitem__))
            keep.add(max(finite, key=values.__getitem__))
    return sorted(keep)


def heat_map(series, columns):
    """Per-series maxima over `columns` equal ranges of steps.

    Returns `{"columns": [[first_step, last_step], ...], "values": [[...]]}`,
    one row per series, `None` where a range holds no point of it.
    """
    all_steps = sorted({d.step for s in series for d in s})
    if not all_steps:
        return {"columns": [], "values": [[] for _ in series]}
    first, last = all_steps[0], all_steps[-1]
    count = min(columns, len(all_steps))
    width = (last - first + 1) / count
    ranges = [[int(first + c * width), int(first + (c + 1) * width) - 1] for c in range(count)]
    ranges[-1][1] = last
    rows = []
    for s in series:
        row = [None] * count
        for d in s:
            c = min(count - 1, int((d.step - first) / width))
            value = d.value
            if not math.isfinite(value):
                row[c] = _finite_or_text(value)
            elif row[c] is None or (isinstance(row[c], float) and value > row[c]):
                row[c] = value
        rows.append(row)
    return {"columns": ranges, "values": rows}


# -- HTTP helpers ------------------------------------------------------------------


def _context(request):
    return (
        context.from_environ(request.environ),
        plugin_util.experiment_id(request.environ),
    )


def _required(request, name):
    value = request.args.get(name)
    if value is None:
        raise errors.InvalidArgumentError(f"Missing required query parameter: {name}")
    return value


def _positive_int(request, name, default):
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_POINTS:
        raise errors.InvalidArgumentError(
            f"`{name}` must be an integer from 1 to {MAX_POINTS}. Received: {name}={raw!r}"
        )
    return value


def _finite_or_text(value):
    """JSON has no NaN or Infinity: those become the strings JavaScript parses."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _json(request, payload):
    body = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    return http_util.Respond(request, body, "application/json")
