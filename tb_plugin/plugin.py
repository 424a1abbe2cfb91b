"""The "Accumulation" TensorBoard plugin: JSON routes and the ES-module page.

Every route is a thin HTTP wrapper around a plain `*_impl` function that
answers its JSON text, reading through `context.data_provider` only (see
`http_api.md`); what is kept between requests is in `cache.py`, the
downsampling for drawing in `downsample.py`.
"""

import collections
import functools
import importlib.resources
import math
import numbers

from tensorboard import context
from tensorboard import errors
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_plugin import cache
from tfaccum import dashboard_schema
from tb_plugin.downsample import downsample_min_max
from tb_plugin.downsample import finite_or_text
from tb_plugin.downsample import heat_map

DEFAULT_POINTS = 1000  # points per chart line sent to the page
DEFAULT_COLUMNS = 120  # heat map columns sent to the page
MAX_POINTS = 100_000
READ_FACTOR = 4  # points read from the data provider per point drawn
_ALL = 2**62  # `--samples_per_plugin=accumulation=0`: everything kept
_APPLIED = dashboard_schema.TAG_PREFIX + "applied_gradient_norm"
_STATIC = ("index.js", "model.js", "views.js", "charts.js")


class AccumulationPlugin(base_plugin.TBPlugin):
    """Serves the Accumulation dashboard."""

    plugin_name = dashboard_schema.PLUGIN_NAME

    def __init__(self, context):
        self._data_provider = context.data_provider
        hint = (context.sampling_hints or {}).get(self.plugin_name)
        self._downsample_to = _ALL if hint == 0 else (hint or dashboard_schema.DEFAULT_SAMPLES)
        self._answers = cache.AnswerCache()
        self._listings = cache.Listings()

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
        return _respond_json(request, self.runs_impl(ctx, experiment))

    @wrappers.Request.application
    def _serve_series(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        points = _positive_int(request, "points", DEFAULT_POINTS)
        columns = _positive_int(request, "columns", DEFAULT_COLUMNS)
        return _respond_json(request, self.series_impl(ctx, experiment, run, points, columns))

    @wrappers.Request.application
    def _serve_events(self, request):
        ctx, experiment = _context(request)
        run = _required(request, "run")
        return _respond_json(request, self.events_impl(ctx, experiment, run))

    # -- the plain functions behind the routes: JSON text -------------------------------

    def runs_impl(self, ctx, experiment):
        """Runs with accumulation data (or problems reading it), sorted by name."""
        listing = self._list(ctx, experiment)
        generation = tuple((run, listed.generation) for run, listed in sorted(listing.items()))
        return self._answers.get(("runs", experiment), generation, lambda: self._runs(listing))

    def series_impl(self, ctx, experiment, run, points=DEFAULT_POINTS,
                    columns=DEFAULT_COLUMNS):
        """Per-update series of one run, downsampled for drawing."""
        listed = self._listed_run(ctx, experiment, run)
        return self._answers.get(
            ("series", experiment, run, points, columns), listed.generation,
            lambda: self._series(ctx, experiment, run, listed, points, columns))

    def events_impl(self, ctx, experiment, run):
        """Leftover events and the latest counters of one run."""
        listed = self._listed_run(ctx, experiment, run)
        return self._answers.get(("events", experiment, run), listed.generation,
                                 lambda: self._events(ctx, experiment, run, listed))

    # -- plain functions ------------------------------------------------------------

    def _list(self, ctx, experiment, run=None):
        """`{run: _Listed}`: each run's readable series, problems and data generation.

        A tag whose plugin metadata cannot be read is left out and reported
        for its run; every other tag and run is still served. Kept for
        `cache.LISTING_SECONDS`.
        """
        return self._listings.get((experiment, run),
                                  lambda: self._list_now(ctx, experiment, run))

    def _list_now(self, ctx, experiment, run):
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
                        f"> {dashboard_schema.PROTO_VERSION}); upgrade tfaccum to read it; "
                        "skipped"))
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

    def _runs(self, listing):
        runs = []
        for run, listed in sorted(listing.items()):
            applied = listed.tags.get(_APPLIED)
            runs.append({
                "run": run,
                "updates": applied[1].max_step if applied else 0,
                "variables": sum(
                    1 for data, _ in listed.tags.values()
                    if data.kind == dashboard_schema.Kind.ACCUMULATOR_NORM
                ),
                "problems": listed.problems,
            })
        return {"runs": runs, "vocabulary": dashboard_schema.VOCABULARY}

    def _series(self, ctx, experiment, run, listed, points, columns):
        tags, problems = listed.tags, list(listed.problems)
        update_tags = [dashboard_schema.TAG_PREFIX + name
                       for name, _ in dashboard_schema.UPDATE_SERIES]
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
        columns_by_name = {}
        for name, _ in dashboard_schema.UPDATE_SERIES:
            by_step = dict(data.get(dashboard_schema.TAG_PREFIX + name, []))
            columns_by_name[name] = [by_step.get(step) for step in steps]
        series = {name: [finite_or_text(v) for v in column]
                  for name, column in columns_by_name.items()}
        policy_tag = dashboard_schema.TAG_PREFIX + "leftover/policy"
        policies = self._read(ctx, experiment, run, [policy_tag] if policy_tag in tags else [],
                              _ALL, [])  # what cannot be read is the events route's to report
        advice = dashboard_schema.run_advice(
            steps, columns_by_name["noise_scale"], columns_by_name["window_items"],
            columns_by_name["window_samples"], columns_by_name["window_micro_batches"],
            [step for step, value in policies.get(policy_tag, []) if _policy(value) == "flush"])
        variables = sorted(
            (d.variable, tag) for tag, (d, _) in tags.items()
            if d.kind == dashboard_schema.Kind.ACCUMULATOR_NORM
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
            "advice": {key: finite_or_text(value) if isinstance(value, float) else value
                       for key, value in advice.items()},
            "problems": problems,
        }

    def _events(self, ctx, experiment, run, listed):
        tags, problems = listed.tags, list(listed.problems)
        names = [dashboard_schema.TAG_PREFIX + name for name, _ in dashboard_schema.LEFTOVER_SERIES]
        data = self._read(ctx, experiment, run, [t for t in names if t in tags], _ALL, problems)
        policies, micro_batches, samples = (dict(data.get(tag, [])) for tag in names)
        events = []
        for step, value in sorted(policies.items()):
            policy = _policy(value)
            if policy is None:
                problems.append(_problem(names[0], (
                    f"{names[0]}: step {step}: leftover policy {value!r} is not one of "
                    + ", ".join(f"{i} ({p})"
                                for i, p in enumerate(dashboard_schema.LEFTOVER_POLICIES))
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
            [t for t in [_APPLIED] + [dashboard_schema.TAG_PREFIX + n for n in counter_names]
             if t in tags],
            problems)

        def last_value(name):
            tag = dashboard_schema.TAG_PREFIX + name
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
    policies = dashboard_schema.LEFTOVER_POLICIES
    if math.isfinite(value) and value == int(value) and 0 <= value < len(policies):
        return policies[int(value)]
    return None


def _count(tag, step, value, problems):
    """A counter as an `int`; `None` (reported) if it is not finite."""
    if math.isfinite(value):
        return int(value)
    problems.append(_problem(tag, f"{tag}: step {step}: {finite_or_text(value)} is not a "
                                  "count; reported as null"))
    return None


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


def _respond_json(request, body):
    return http_util.Respond(request, body, "application/json")


# -- listings ----------------------------------------------------------------------


class _Listed(collections.namedtuple("_Listed", "tags problems generation")):
    """One run as listed: `{tag: (PluginData, ScalarTimeSeries)}`, problems, generation."""


@functools.lru_cache(maxsize=4096)
def _parse_plugin_metadata(content):
    return dashboard_schema.parse_plugin_metadata(content)


