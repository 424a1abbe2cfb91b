"""The "Accumulation" TensorBoard plugin: JSON routes and the ES-module page.

Every route is a thin HTTP wrapper around a plain `*_impl` function that reads
through `context.data_provider` only (see `http_api.md`).
"""

import collections
import functools
import importlib.resources
import json
import math
import numbers
import threading

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
        self._answers = AnswerCache()

    def get_plugin_apps(self):
        apps = {"/runs": self._serve_runs, "/series": self._serve_series,
                "/events": self._serve_events}
        for name in _STATIC:
            apps["/" + name] = self._serve_static
        return {path: _read_only(app) for path, app in apps.items()}

    def is_active(self):
        return False  # TensorBoard asks the data provider which plugins have data

    def frontend_metadata(self):
        return base_plugin.FrontendMetadata(
            es_module_path="/index.js", tab_name="Accumulation"
        )

    # -- HTTP wrappers ------------------------------------------------------------

    @wrappers.Request.application
    def _serve_static(self, request):
        name = request.path.rsplit("/", 1)[-1]  # TensorBoard routes "index.js/" here too
        if name not in _STATIC:
            raise errors.NotFoundError(f"No file {request.path!r} in tb_plugin/static")
        body = importlib.resources.files("tb_plugin").joinpath("static", name).read_bytes()
        return http_util.Respond(request, body, "text/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request):
        ctx, experiment = _context(request)
        listing = self._list(ctx, experiment)
        generation = tuple((run, listed.generation) for run, listed in sorted(listing.items()))
        body = self._answers.get(("runs", experiment), generation,
                                 lambda: self._runs(listing))
        return _respond_json(request, body)

    @wrappers.Request.application
    def _serve_series(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        points = _positive_int(request, "points", DEFAULT_POINTS)
        columns = _positive_int(request, "columns", DEFAULT_COLUMNS)
        listed = self._listed_run(ctx, experiment, run)
        body = self._answers.get(
            ("series", experiment, run, points, columns), listed.generation,
            lambda: self._series(ctx, experiment, run, listed, points, columns))
        return _respond_json(request, body)

    @wrappers.Request.application
    def _serve_events(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        listed = self._listed_run(ctx, experiment, run)
        body = self._answers.get(("events", experiment, run), listed.generation,
                                 lambda: self._events(ctx, experiment, run, listed))
        return _respond_json(request, body)

    # -- plain functions ------------------------------------------------------------

    def _list(self, ctx, experiment, run=None):
        """`{run: _Listed}`: each run's readable series, problems and data generation.

        A tag whose plugin metadata cannot be read is left out and reported
        for its run; every other tag and run is still served.
        """
        run_filter = None if run is None else provider.RunTagFilter(runs=[run])
        listing = self._data_provider.list_scalars(
            ctx, experiment_id=experiment, plugin_name=self.plugin_name,
            run_tag_filter=run_filter,
        )
        result = {}
        for run_name, tags in listing.items():
            readable, problems = {}, []
            for tag, series in tags.items():
                try:
                    data = _parse_plugin_metadata(series.plugin_content)
                except ValueError as error:
                    problems.append(_problem(tag, f"{tag}: {error}; skipped"))
                    continue
                if data is None:
                    problems.append(_problem(
                        tag, f"{tag}: written by a newer tfaccum (plugin data version "
                        f"> {metadata.PROTO_VERSION}); upgrade tfaccum to read it; skipped"))
                    continue
                readable[tag] = (data, series)
            # New points move a tag's last step or wall time: cached answers
            # of the run are valid while this stays the same.
            generation = tuple(sorted(
                (tag, series.max_step, series.max_wall_time) for tag, series in tags.items()))
            result[run_name] = _Listed(readable, problems, generation)
        return result

    def _guarded(self, read, run, tags, problems):
        """`read(tags)[run]`, tag by tag where the whole read fails.

        TensorBoard's Python loader raises for the whole request when one tag
        holds a tensor it cannot turn into a scalar (a vector, a string); such
        a tag is reported and left out.
        """
        if not tags:
            return {}
        try:
            return read(tags).get(run, {})
        except Exception:  # noqa: BLE001 - event files can hold anything
            pass
        result = {}
        for tag in tags:
            try:
                result.update(read([tag]).get(run, {}))
            except Exception as error:  # noqa: BLE001
                problems.append(_problem(
                    tag, f"{tag}: not a scalar series ({type(error).__name__}: {error}); skipped"))
        return result

    def _read(self, ctx, experiment, run, tags, downsample, problems):
        """`{tag: [(step, value)]}` of real-valued points; the rest reported."""
        def read(some):
            return self._data_provider.read_scalars(
                ctx, experiment_id=experiment, plugin_name=self.plugin_name,
                downsample=downsample,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(some)),
            )
        data = self._guarded(read, run, list(tags), problems)
        return {tag: _real_points(tag, datums, problems) for tag, datums in data.items()}

    def _read_last(self, ctx, experiment, run, tags, problems):
        """`{tag: (step, value)}`: the last point of each tag, if it is a real number."""
        def read(some):
            return self._data_provider.read_last_scalars(
                ctx, experiment_id=experiment, plugin_name=self.plugin_name,
                run_tag_filter=provider.RunTagFilter(runs=[run], tags=list(some)),
            )
        data = self._guarded(read, run, list(tags), problems)
        result = {}
        for tag, datum in data.items():
            points = _real_points(tag, [datum], problems)
            if points:
                result[tag] = points[0]
        return result

    def _listed_run(self, ctx, experiment, run):
        listed = self._list(ctx, experiment, run).get(run)
        if listed is None:
            raise errors.NotFoundError(f"No accumulation data for run {run!r}")
        return listed

    def runs_impl(self, ctx, experiment):
        """Runs with accumulation data (or problems reading it), sorted by name."""
        return self._runs(self._list(ctx, experiment))

    def _runs(self, listing):
        runs = []
        for run, listed in sorted(listing.items()):
            applied = listed.tags.get(_APPLIED)
            runs.append({
                "run": run,
                "updates": applied[1].max_step if applied else 0,
                "variables": sum(
                    1 for data, _ in listed.tags.values()
                    if data.kind == metadata.Kind.ACCUMULATOR_NORM
                ),
                "problems": listed.problems,
            })
        return {"runs": runs, "vocabulary": metadata.VOCABULARY}

    def series_impl(self, ctx, experiment, run, points=DEFAULT_POINTS,
                    columns=DEFAULT_COLUMNS):
        """Per-update series of one run, downsampled for drawing."""
        listed = self._listed_run(ctx, experiment, run)
        return self._series(ctx, experiment, run, listed, points, columns)

    def _series(self, ctx, experiment, run, listed, points, columns):
        tags, problems = listed.tags, list(listed.problems)
        update_tags = [metadata.TAG_PREFIX + name for name, _ in metadata.UPDATE_SERIES]
        # Read a bounded sample of what TensorBoard keeps, then pick the
        # extremes of it: long runs stay fast, spikes stay visible. Series
        # written together have the same steps, so the provider's
        # deterministic sampling keeps them aligned.
        read = min(self._downsample_to, READ_FACTOR * points)
        data = self._read(ctx, experiment, run, [t for t in update_tags if t in tags], read,
                          problems)
        # One point per step, the last written (as for every other series),
        # in step order: a run written twice into one directory repeats steps.
        applied = sorted(dict(data.get(_APPLIED, [])).items())
        keep = downsample_min_max([value for _, value in applied], points)
        steps = [applied[i][0] for i in keep]
        series = {}
        for name, _ in metadata.UPDATE_SERIES:
            by_step = dict(data.get(metadata.TAG_PREFIX + name, []))
            series[name] = [_finite_or_text(by_step.get(step)) for step in steps]
        variables = sorted(
            (d.variable, tag) for tag, (d, _) in tags.items()
            if d.kind == metadata.Kind.ACCUMULATOR_NORM
        )
        norms = self._read(ctx, experiment, run, [tag for _, tag in variables],
                           min(self._downsample_to, READ_FACTOR * columns), problems)
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
            "problems": problems,
        }

    def events_impl(self, ctx, experiment, run):
        """Leftover events and the latest counters of one run."""
        return self._events(ctx, experiment, run, self._listed_run(ctx, experiment, run))

    def _events(self, ctx, experiment, run, listed):
        tags, problems = listed.tags, list(listed.problems)
        names = [metadata.TAG_PREFIX + name for name, _ in metadata.LEFTOVER_SERIES]
        data = self._read(ctx, experiment, run, [t for t in names if t in tags], _ALL, problems)
        policies, micro_batches, samples = (dict(data.get(tag, [])) for tag in names)
        events = []
        for step, value in sorted(policies.items()):
            policy = _policy(value)
            if policy is None:
                problems.append(_problem(names[0], (
                    f"{names[0]}: step {step}: leftover policy {value!r} is not one of "
                    + ", ".join(f"{i} ({p})" for i, p in enumerate(metadata.LEFTOVER_POLICIES))
                    + "; event skipped")))
                continue
            events.append({
                "step": step,
                "policy": policy,
                "micro_batches": _count(names[1], step, micro_batches.get(step, 0), problems),
                "samples": _count(names[2], step, samples.get(step, 0), problems),
            })
        counter_names = ("micro_steps", "skipped_updates", "nonfinite_skips")
        last = self._read_last(
            ctx, experiment, run,
            [t for t in [_APPLIED] + [metadata.TAG_PREFIX + n for n in counter_names] if t in tags],
            problems)

        def last_value(name):
            tag = metadata.TAG_PREFIX + name
            return _count(tag, last[tag][0], last[tag][1], problems) if tag in last else None

        applied = last.get(_APPLIED)
        return {
            "run": run,
            "events": events,
            "counters": {
                "optimizer_steps": None if applied is None else applied[0],
                **{name: last_value(name) for name in counter_names},
                "flushes": sum(e["policy"] == "flush" for e in events),
                "carries": sum(e["policy"] == "carry" for e in events),
                "dropped_micro_steps": sum(
                    e["micro_batches"] or 0 for e in events if e["policy"] == "drop"
                ),
            },
            "problems": problems,
        }


# -- reading hostile values --------------------------------------------------------


def _problem(tag, reason):
    return {"tag": tag, "reason": reason}


def _real_points(tag, datums, problems):
    """`[(step, float)]` of the datums whose value is a real number; the rest reported."""
    points, rejected = [], []
    for datum in datums:
        value = datum.value
        if isinstance(value, numbers.Real):
            points.append((datum.step, float(value)))
        else:
            rejected.append(value)
    if rejected:
        problems.append(_problem(tag, (
            f"{tag}: {len(rejected)} value(s) are not real numbers "
            f"(e.g. a {type(rejected[0]).__name__}); skipped")))
    return points


def _policy(value):
    """The policy a leftover event stores as its index, or `None` if it is none."""
    if math.isfinite(value) and value == int(value) and 0 <= value < len(metadata.LEFTOVER_POLICIES):
        return metadata.LEFTOVER_POLICIES[int(value)]
    return None


def _count(tag, step, value, problems):
    """A counter as an `int`; `None` (reported) if it is not finite."""
    if math.isfinite(value):
        return int(value)
    problems.append(_problem(tag, f"{tag}: step {step}: {_finite_or_text(value)} is not a "
                                  "count; reported as null"))
    return None


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

    Each series is a list of `(step, value)` points.

    Returns `{"columns": [[first_step, last_step], ...], "values": [[...]]}`,
    one row per series, `None` where a range holds no point of it.
    """
    all_steps = sorted({step for s in series for step, _ in s})
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
        for step, value in s:
            c = min(count - 1, int((step - first) / width))
            if not math.isfinite(value):
                row[c] = _finite_or_text(value)
            elif row[c] is None or (isinstance(row[c], float) and value > row[c]):
                row[c] = value
        rows.append(row)
    return {"columns": ranges, "values": rows}


# -- HTTP helpers ------------------------------------------------------------------


def _read_only(app):
    """`app` for GET and HEAD; every other method is answered 405."""

    def guarded(environ, start_response):
        method = environ.get("REQUEST_METHOD", "GET")
        if method in ("GET", "HEAD"):
            return app(environ, start_response)
        response = wrappers.Response(
            f"Method {method} not allowed: the Accumulation plugin's routes are read-only "
            "(GET, HEAD).\n", status=405, headers={"Allow": "GET, HEAD"},
            content_type="text/plain; charset=utf-8")
        return response(environ, start_response)

    return guarded


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


def _respond_json(request, body):
    return http_util.Respond(request, body, "application/json")


# -- answers kept per run and data generation -----------------------------------------


class _Listed(collections.namedtuple("_Listed", "tags problems generation")):
    """One run as listed: `{tag: (PluginData, ScalarTimeSeries)}`, problems, generation."""


@functools.lru_cache(maxsize=4096)
def _parse_plugin_metadata(content):
    return metadata.parse_plugin_metadata(content)


class AnswerCache:
    """Serialized JSON answers, kept while their run's data is unchanged.

    A team sharing one TensorBoard asks for the same runs again and again;
    TensorBoard only changes what a run holds when it reloads the logs. An
    answer is kept under its request (route, experiment, run, parameters)
    with the data generation it was computed from, and recomputed once that
    changes. Concurrent requests for the same missing answer compute it once.
    The least recently used answers go first beyond `size` entries.
    """

    def __init__(self, size=128):
        self._size = size
        self._answers = collections.OrderedDict()  # key -> (generation, body)
        self._lock = threading.Lock()
        self._computing = {}  # key -> Lock held by the thread computing it

    def get(self, key, generation, compute):
        """The body for `key` at `generation`, from `compute()` if not kept."""
        with self._lock:
            kept = self._answers.get(key)
            if kept is not None and kept[0] == generation:
                self._answers.move_to_end(key)
                return kept[1]
            computing = self._computing.setdefault(key, threading.Lock())
        with computing:
            with self._lock:
                kept = self._answers.get(key)
                if kept is not None and kept[0] == generation:
                    return kept[1]
            body = json.dumps(compute(), allow_nan=False, separators=(",", ":"))
            with self._lock:
                self._answers[key] = (generation, body)
                self._answers.move_to_end(key)
                while len(self._answers) > self._size:
                    self._answers.popitem(last=False)
                self._computing.pop(key, None)
            return body
