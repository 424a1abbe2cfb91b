"""The Accumulation dashboard in a real browser: TensorBoard + headless Chromium.

Event files come from the real callback; TensorBoard runs as a subprocess on
127.0.0.1; Playwright drives Chromium through the page a user opens. Skipped
when Chromium or Playwright is missing, except with CI=true, where that fails.
Set TFACCUM_SCREENSHOT=path.png to save a screenshot of the dashboard.
"""

import json
import math
import os
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import tensorflow as tf

from reference import make_data
from reference import make_model
from tensorboard_server import TensorBoard

from tfaccum import dashboard_schema
from tb_plugin.downsample import finite_or_text
from tfaccum import GradientAccumulationCallback

# Its module-scoped fixtures are built once: its tests share a worker.
pytestmark = pytest.mark.xdist_group("test_dashboard_browser")

REPO = Path(__file__).resolve().parents[1]
MALICIOUS = "<img src=x onerror=alert(1)>"
EPOCHS = 3
API = "data/plugin/accumulation/"
ENTRY = "data/plugin_entry.html?name=accumulation"  # the tab's iframe document
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
TIMEOUT_S = 60

# What the page drew, read from the DOM attributes the dashboard sets for tests.
READ_DASHBOARD = """() => {
  const byRun = (selector, attr) => Object.fromEntries(
    [...document.querySelectorAll(selector)].map((e) => [e.dataset.run, Number(e.dataset[attr])]));
  return {
    lines: byRun('path.applied[data-run]', 'points'),
    loss: byRun('path.loss[data-run]', 'points'),
    markers: byRun('g.events[data-run]', 'markers'),
    nonfinite: byRun('g.nonfinite[data-run]', 'count'),
    policies: Object.fromEntries([...document.querySelectorAll('g.events[data-run]')].map((g) =>
      [g.dataset.run, [...g.querySelectorAll('.marker')].map((m) => m.getAttribute('class'))])),
    counters: Object.fromEntries([...document.querySelectorAll('tr[data-run]')].map((tr) =>
      [tr.dataset.run, Object.fromEntries([...tr.querySelectorAll('[data-counter]')].map(
        (td) => [td.dataset.counter, td.textContent]))])),
    runLabels: [...document.querySelectorAll('label[data-run]')].map((l) => l.textContent),
    noise: byRun('path.noise-scale[data-run]', 'points'),
    noiseNonFinite: byRun('g.noise-nonfinite[data-run]', 'count'),
    batch: byRun('path.effective-batch[data-run]', 'points'),
    hints: Object.fromEntries([...document.querySelectorAll('[data-hint-run]')].map((e) =>
      [e.dataset.hintRun, {advice: e.dataset.advice, steps: e.dataset.suggestedSteps,
        batch: e.dataset.batch, text: e.textContent}])),
    heat: [...document.querySelectorAll('svg.heat')].map((s) =>
      [s.dataset.run, Number(s.dataset.rows), Number(s.dataset.columns)]),
    images: document.querySelectorAll('img').length,
    status: document.querySelector('.status').textContent,
  };
}"""

READY = "document.body && document.body.dataset.ready === 'true'"
IDLE = "!document.getElementById('accumulation-dashboard').dataset.loading"


def as_number(value):
    """A /series value as JavaScript's Number() reads it ("NaN" and co. included)."""
    return None if value is None else float(value)


def expected_advice(series, events):
    """The batch-size advisor's rule, from a run's /series and /events JSON.

    B_simple: the last finite, positive noise_scale. B: window_samples of the
    last update, skipping one that flushed a partial window (unless all did);
    micro-batch: B / window_micro_batches there. Returns (advice, suggested
    accumulation_steps or "", B or None).
    """
    def usable(v):
        return v is not None and math.isfinite(v) and v > 0

    steps = series["steps"]
    column = {name: [as_number(v) for v in values] for name, values in series["series"].items()}
    estimates = [v for v in column["noise_scale"] if usable(v)]
    flushed = {e["step"] for e in events["events"] if e["policy"] == "flush"}
    windows = [i for i in range(len(steps))
               if usable(column["window_samples"][i]) and usable(column["window_micro_batches"][i])]
    full = [i for i in windows if steps[i] not in flushed]
    if not estimates or not windows:
        return "unknown", "", None
    at = (full or windows)[-1]
    noise, batch = estimates[-1], column["window_samples"][at]
    micro_batch = batch / column["window_micro_batches"][at]
    # The rule as the callback applies it: one definition, in dashboard_schema.
    suggested = dashboard_schema.suggested_accumulation_steps(noise, micro_batch)
    return dashboard_schema.batch_advice(batch, noise), str(suggested), batch


# -- browser ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    problems = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problems.append("the `playwright` Python package (`pip install playwright`; "
                        "it drives the system Chromium, no browser download)")
    executable = next((p for p in ("/usr/bin/chromium", shutil.which("chromium"))
                       if p and os.path.exists(p)), None)
    if executable is None:
        problems.append("Chromium at /usr/bin/chromium or on PATH (`apt-get install chromium`)")
    if problems:
        message = "The dashboard browser test needs " + " and ".join(problems) + "."
        if os.environ.get("CI") == "true":
            pytest.fail(message + " Install what is missing: with CI=true this test fails "
                        "instead of skipping.")
        pytest.skip(message)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def open_page(browser, url):
    """A new page at `url`; collects dialogs (dismissed) and uncaught errors."""
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    page.set_default_timeout(TIMEOUT_S * 1000)
    page.dialogs, page.errors = [], []
    page.on("dialog", lambda dialog: (page.dialogs.append(dialog.message), dialog.dismiss()))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.goto(url)
    return page


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs written by the real callback, and the callback's own counters."""
    root = tmp_path_factory.mktemp("dashboard_logs")
    x, y = make_data()
    counters = {}
    for name, leftover in (("run-flush", "flush"), (MALICIOUS, "drop")):
        callback = GradientAccumulationCallback(
            accumulation_steps=4, leftover=leftover, log_dir=str(root / name))
        make_model().fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=False, verbose=0,
                         callbacks=[callback])
        counters[name] = {
            "optimizer_steps": callback.optimizer_steps,
            "micro_steps": callback.micro_steps,
            "skipped_updates": callback.micro_steps - callback.optimizer_steps,
            "flushes": callback.flushes,
            "dropped_micro_steps": callback.dropped_micro_steps,
        }
    return root, counters


@pytest.fixture(scope="module")
def served(runs):
    """TensorBoard serving `runs`, once it has loaded all of them."""
    root, counters = runs
    server = TensorBoard(root)
    try:
        server.wait_started()

        def loaded(tb):
            for name, expected in counters.items():
                got = tb.get_json(API + "events?run=" + urllib.parse.quote(name))["counters"]
                if (got["optimizer_steps"], got["micro_steps"]) != (
                        expected["optimizer_steps"], expected["micro_steps"]):
                    return False
            return True

        server.wait_for(loaded, "the finished runs")
        yield server, counters
    finally:
        server.stop()


# -- tests ------------------------------------------------------------------------


def test_dashboard_draws_what_the_callback_wrote(browser, served):
    server, counters = served
    page = open_page(browser, server.url + "#accumulation")
    iframe = page.wait_for_selector(f'iframe[src*="{ENTRY}"]', state="attached")
    frame = iframe.content_frame()
    frame.wait_for_function(READY)
    seen = frame.evaluate(READ_DASHBOARD)

    assert seen["status"] == ""
    assert set(seen["lines"]) == set(counters)
    flush, drop = counters["run-flush"], counters[MALICIOUS]
    assert flush["flushes"] == EPOCHS and drop["dropped_micro_steps"] == EPOCHS
    for name, expected in counters.items():
        assert seen["lines"][name] == expected["optimizer_steps"], name
        # The window loss: one point per update, from the callback's losses.
        assert seen["loss"][name] == expected["optimizer_steps"], name
        assert seen["nonfinite"][name] == 0, name
        # The table shows the callback's own counters...
        table = seen["counters"][name]
        assert {key: int(table[key]) for key in expected} == expected, name
        assert table["carries"] == "0", name
        # ...and every counter of /events as plain text, "—" for null.
        api = server.get_json(API + "events?run=" + urllib.parse.quote(name))["counters"]
        assert table == {key: "—" if v is None else str(v) for key, v in api.items()}, name
    # One marker per leftover event: a flush per epoch, or a drop (of 1 micro-batch) per epoch.
    assert seen["markers"] == {"run-flush": EPOCHS, MALICIOUS: EPOCHS}
    assert seen["policies"]["run-flush"] == ["marker marker-flush"] * EPOCHS
    assert seen["policies"][MALICIOUS] == ["marker marker-drop"] * EPOCHS
    # Batch-size advisor: B_simple where /series defines it, the effective batch at
    # every update, and the advice the rule gives for the same JSON.
    assert set(seen["noise"]) == set(seen["batch"]) == set(seen["hints"]) == set(counters)
    for name, expected in counters.items():
        query = "?run=" + urllib.parse.quote(name)
        series = server.get_json(API + "series" + query)
        events = server.get_json(API + "events" + query)
        defined = [v for v in series["series"]["noise_scale"] if v is not None]
        assert 0 < len(defined) <= expected["optimizer_steps"], name
        assert seen["noise"][name] == len(defined), name
        assert seen["noiseNonFinite"][name] == 0, name
        assert seen["batch"][name] == len(series["steps"]) == expected["optimizer_steps"], name
        advice, steps, batch = expected_advice(series, events)
        hint = seen["hints"][name]
        assert (hint["advice"], hint["steps"]) == (advice, steps), (name, hint)
        assert float(hint["batch"]) == batch, name
        assert hint["text"].startswith(name + ": "), name
    # run-flush ends on a flushed partial window (1 micro-batch): B is the full window's.
    assert float(seen["hints"]["run-flush"]["batch"]) == 32
    assert "flushed at update" in seen["hints"]["run-flush"]["text"]
    assert frame.get_by_text("An Empirical Model of Large-Batch Training").count() == 1

    # The heat map of the first run: 4 variables, a column per update (fewer than 120).
    assert seen["heat"] == [[MALICIOUS, 4, drop["optimizer_steps"]]]

    # The run named like markup is shown as text, never parsed as HTML.
    assert MALICIOUS in seen["runLabels"]
    assert frame.get_by_text(MALICIOUS, exact=True).count() >= 2  # selector label, table
    assert seen["images"] == 0
    assert page.locator("img[src='x']").count() == 0
    assert page.dialogs == [] and page.errors == []

    # Choosing the other run for the heat map, then unselecting a run.
    frame.select_option("#heat-run", "run-flush")
    frame.wait_for_function("document.querySelector('svg.heat').dataset.run === 'run-flush'")
    frame.locator('input[data-run="run-flush"]').uncheck()
    frame.wait_for_function(f"document.querySelectorAll('path.applied').length === 1 && {IDLE}")
    seen = frame.evaluate(READ_DASHBOARD)
    assert list(seen["lines"]) == list(seen["counters"]) == [MALICIOUS]
    assert seen["heat"][0][0] == MALICIOUS
    assert page.dialogs == [] and page.errors == []

    if os.environ.get("TFACCUM_SCREENSHOT"):
        shot = open_page(browser, server.url + ENTRY)
        shot.wait_for_function(READY)
        shot.screenshot(path=os.environ["TFACCUM_SCREENSHOT"], full_page=True)
        shot.close()
    page.close()


def test_non_finite_values_and_failed_fetches(browser, served):
    server, counters = served
    page = open_page(browser, "about:blank")

    def with_non_finite(route):
        response = route.fetch()
        body = response.json()
        applied = body["series"]["applied_gradient_norm"]
        applied[1:4] = ["NaN", "Infinity", "-Infinity"]
        body["series"]["micro_norm_max"][2] = "Infinity"
        body["accumulators"]["values"][0][:2] = ["NaN", None]
        route.fulfill(response=response, json=body)

    page.route(re.compile(re.escape(API + "series?")), with_non_finite)
    page.goto(server.url + ENTRY)
    page.wait_for_function(READY)
    seen = page.evaluate(READ_DASHBOARD)
    assert seen["status"] == ""
    for name, expected in counters.items():
        assert seen["lines"][name] == expected["optimizer_steps"] - 3, name
        assert seen["nonfinite"][name] == 3, name
    assert page.errors == []

    # A failing route shows its message instead of a chart.
    page.unroute_all()
    page.route(re.compile(re.escape(API + "events?")),
               lambda route: route.fulfill(status=500, body="boom"))
    page.get_by_role("button", name="Reload").click()
    page.wait_for_selector(".status.error")
    assert "500 boom" in page.locator(".status").text_content()
    assert page.locator("path.applied").count() == 0
    assert page.errors == [] and page.dialogs == []
    page.unroute_all(behavior="ignoreErrors")
    page.close()


# Synthetic runs for the advisor: (noise_scale, window_samples, window_micro_batches,
# flushed steps, expected advice, suggested steps, B_simple points drawn, non-finite).
ADVISOR_CASES = {
    # B = 64 > 2 x 17 (the last finite estimate; "Infinity" is marked, not drawn).
    "less": ([None, 30, "Infinity", 17], [64] * 4, [8] * 4, [], "less", "2", 2, 1),
    # B = 16 < 90 / 2 with the last defined estimate before a trailing null.
    "more": ([None, 80, 90, None], [16] * 4, [2] * 4, [], "more", "11", 2, 0),
    # The flushed partial window (8 samples) is left out: B = 32, within 2x of 40.
    "good": ([40, 40, 40], [32, 32, 8], [4, 4, 1], [3], "good", "5", 3, 0),
    # B = 2 x B_simple exactly is still "good".
    "good-edge": ([32], [64], [8], [], "good", "4", 1, 0),
    # 20 / 8 = 2.5 rounds half up to 3, in Python (metadata) as in the page.
    "half-up": ([20], [64], [8], [], "less", "3", 1, 0),
    "unknown": ([None, "NaN"], [16, 16], [2, 2], [], "unknown", "", 0, 1),
}


def synthetic_run(run):
    noise, samples, micro_batches, flushed = ADVISOR_CASES[run][:4]
    n = len(noise)
    ones = [1.0] * n
    series = {
        "run": run, "sampled": n, "steps": list(range(1, n + 1)),
        "series": {
            "applied_gradient_norm": ones, "micro_norm_mean": ones, "micro_norm_max": ones,
            "window_micro_batches": micro_batches, "window_samples": samples,
            "micro_steps": ones, "skipped_updates": ones, "nonfinite_skips": ones,
            "noise_scale": noise,
        },
        "accumulators": {"variables": [], "columns": [], "values": []},
    }
    # The advice the series route computes (`dashboard_schema.run_advice`) from these numbers.
    numbers = [None if v is None else float(v) for v in noise]
    advice = dashboard_schema.run_advice(series["steps"], numbers, [None] * n, samples, micro_batches,
                                         flushed)
    series["advice"] = {key: finite_or_text(value) if isinstance(value, float) else value
                        for key, value in advice.items()}
    events = {
        "run": run,
        "events": [{"step": step, "policy": "flush", "micro_batches": micro_batches[step - 1],
                    "samples": samples[step - 1]} for step in flushed],
        "counters": {"optimizer_steps": n, "micro_steps": None, "skipped_updates": None,
                     "nonfinite_skips": None, "flushes": len(flushed), "carries": 0,
                     "dropped_micro_steps": 0},
    }
    return series, events


def test_batch_size_advice_for_known_numbers(browser, served):
    server, _ = served
    page = open_page(browser, "about:blank")

    def synthetic(route):
        url = urllib.parse.urlsplit(route.request.url)
        route_name = url.path.rsplit("/", 1)[-1]
        if route_name == "runs":
            body = {"runs": [{"run": run, "updates": len(case[0]), "variables": 0}
                             for run, case in ADVISOR_CASES.items()],
                    "vocabulary": dashboard_schema.VOCABULARY}
        else:
            run = urllib.parse.parse_qs(url.query)["run"][0]
            body = dict(zip(("series", "events"), synthetic_run(run)))[route_name]
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route(re.compile(re.escape(API) + r"(runs|series|events)\b"), synthetic)
    page.goto(server.url + ENTRY)
    page.wait_for_function(READY)
    seen = page.evaluate(READ_DASHBOARD)
    assert seen["status"] == ""
    for run, case in ADVISOR_CASES.items():
        advice, steps, points, nonfinite = case[4:]
        # The test's own reading of the rule, and the server's, agree with the
        # numbers written here by hand...
        series, events = synthetic_run(run)
        assert expected_advice(series, events)[:2] == (advice, steps), run
        assert (series["advice"]["advice"], str(series["advice"]["suggested_steps"] or "")) == (
            advice, steps), run
        # ...and the page with both.
        hint = seen["hints"][run]
        assert (hint["advice"], hint["steps"]) == (advice, steps), (run, hint)
        assert seen["noise"][run] == points, run
        assert seen["noiseNonFinite"][run] == nonfinite, run
        assert seen["batch"][run] == len(case[1]), run
    texts = {run: hint["text"] for run, hint in seen["hints"].items()}
    assert "Accumulate less." in texts["less"] and "accumulation_steps = 2" in texts["less"]
    assert "Accumulate more." in texts["more"] and "accumulation_steps = 11" in texts["more"]
    assert "Good trade-off." in texts["good"] and "flushed at update 3" in texts["good"]
    assert "accumulation_steps >= 2" in texts["unknown"]
    assert page.errors == [] and page.dialogs == []
    page.unroute_all(behavior="ignoreErrors")
    page.close()


# Delays the JSON of every reply about run-flush by 2 s; counts them once consumed.
SLOW_RUN_FLUSH = """
window.slowDone = 0;
const originalFetch = window.fetch;
window.fetch = async (...args) => {
  const response = await originalFetch(...args);
  if (!String(args[0]).includes('run=run-flush')) return response;
  const json = response.json.bind(response);
  response.json = () => json().then((value) => new Promise((resolve) => setTimeout(() => {
    resolve(value);
    setTimeout(() => { window.slowDone += 1; });  // after the page's reaction to it
  }, 2000)));
  return response;
};
"""


def test_a_reply_for_an_older_selection_is_ignored(browser, served):
    server, counters = served
    page = open_page(browser, "about:blank")
    page.add_init_script(SLOW_RUN_FLUSH)
    page.goto(server.url + ENTRY)
    page.locator('input[data-run="run-flush"]').uncheck()  # while its data is in flight
    page.wait_for_function(f"{READY} && {IDLE}")
    assert page.evaluate("window.slowDone") == 0
    drawn = page.evaluate(READ_DASHBOARD)["lines"]
    assert drawn == {MALICIOUS: counters[MALICIOUS]["optimizer_steps"]}
    page.wait_for_function("window.slowDone === 2")  # series and events of run-flush
    seen = page.evaluate(READ_DASHBOARD)
    assert list(seen["lines"]) == list(seen["counters"]) == [MALICIOUS]
    assert page.errors == []
    page.close()


def test_empty_state_without_accumulation_runs(browser, tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path / "plain"))
    with writer.as_default():
        tf.summary.scalar("loss", 1.0, step=0)
    writer.close()
    server = TensorBoard(tmp_path)
    try:
        server.wait_started()
        server.wait_for(lambda tb: "plain" in tb.get_json("data/runs"), "the plain run")
        assert server.get_json(API + "runs") == {"runs": [], "vocabulary": dashboard_schema.VOCABULARY}
        # TensorBoard shows no tab for a plugin without data: open the tab's document.
        page = open_page(browser, server.url + ENTRY)
        page.wait_for_function(READY)
        empty = page.locator("#empty-state")
        assert empty.is_visible()
        text = empty.text_content()
        assert "No accumulation data was found" in text
        assert 'GradientAccumulationCallback(accumulation_steps=4, log_dir="logs/run-a")' in text
        assert "tensorboard --logdir logs" in text
        assert page.locator("path.applied").count() == 0
        assert page.errors == []
        page.close()
    finally:
        server.stop()


def test_a_hostile_run_is_reported_and_the_good_one_drawn(browser, runs, tmp_path):
    """Undecodable metadata and impossible values in one run; a failing route for another."""
    from test_plugin_hostile import GARBAGE_META
    from test_plugin_hostile import accumulation_meta
    from test_plugin_hostile import write

    good_root, counters = runs
    root = tmp_path
    shutil.copytree(good_root / "run-flush", root / "good")
    applied = dashboard_schema.TAG_PREFIX + "applied_gradient_norm"
    write(root / "hostile", applied, [tf.constant(1.0)] * 3,
          accumulation_meta(dashboard_schema.Kind.APPLIED_GRADIENT_NORM))
    write(root / "hostile", dashboard_schema.TAG_PREFIX + "micro_norm_max", [tf.constant(1.0)] * 3,
          GARBAGE_META)
    write(root / "hostile", dashboard_schema.TAG_PREFIX + "leftover/policy", [tf.constant(7.0)],
          accumulation_meta(dashboard_schema.Kind.LEFTOVER_POLICY))
    server = TensorBoard(root)
    try:
        server.wait_started()
        server.wait_for(lambda tb: len(tb.get_json(API + "runs")["runs"]) == 2, "both runs")
        page = open_page(browser, server.url + ENTRY)
        page.wait_for_function(READY)
        seen = page.evaluate(READ_DASHBOARD)
        assert seen["status"] == ""
        assert seen["lines"] == {"good": counters["run-flush"]["optimizer_steps"], "hostile": 3}
        reported = page.locator('[data-problem-run="hostile"] [data-problem]').all_text_contents()
        assert any("cannot be decoded" in r and "micro_norm_max" in r for r in reported)
        assert any("leftover policy 7.0" in r for r in reported)
        assert page.locator('[data-problem-run="good"]').count() == 0

        # A run whose data cannot be fetched at all is reported; the other still draws.
        page.route(re.compile(re.escape(API + "series?run=hostile")),
                   lambda route: route.fulfill(status=500, body="boom"))
        page.get_by_role("button", name="Reload").click()
        page.wait_for_selector('[data-problem-run="hostile"]:has-text("500 boom")')
        page.wait_for_function(f"{READY} && {IDLE}")
        seen = page.evaluate(READ_DASHBOARD)
        assert seen["status"] == ""
        assert list(seen["lines"]) == ["good"]
        assert "500 boom" in page.locator('[data-problem-run="hostile"]').text_content()
        assert page.errors == [] and page.dialogs == []
        page.unroute_all(behavior="ignoreErrors")
        page.close()
    finally:
        server.stop()
