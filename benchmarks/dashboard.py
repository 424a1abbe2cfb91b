"""How fast the Accumulation plugin answers for many long runs.

Serves 10 runs x 100,000 updates (and 8 variables each) from an in-memory
data provider, so what is timed is the plugin's own work: listing runs, one
`series` and one `events` request per run, as the page makes them.

    python benchmarks/dashboard.py [--runs 10] [--updates 100000]
"""

import argparse
import statistics
import time

import numpy as np
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

from tb_plugin import metadata
from tb_plugin.plugin import AccumulationPlugin


class InMemoryProvider(provider.DataProvider):
    """Scalar series held in memory: {run: {tag: (content, steps, values)}}."""

    def __init__(self, runs):
        self._runs = runs

    def _select(self, run_tag_filter):
        for run, tags in self._runs.items():
            if run_tag_filter and run_tag_filter.runs is not None and run not in run_tag_filter.runs:
                continue
            for tag, entry in tags.items():
                if run_tag_filter and run_tag_filter.tags is not None and tag not in run_tag_filter.tags:
                    continue
                yield run, tag, entry

    def experiment_metadata(self, ctx=None, *, experiment_id):
        return provider.ExperimentMetadata()

    def list_plugins(self, ctx=None, *, experiment_id):
        return [metadata.PLUGIN_NAME]

    def list_runs(self, ctx=None, *, experiment_id):
        return [provider.Run(run_id=r, run_name=r, start_time=0.0) for r in self._runs]

    def list_scalars(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        result = {}
        for run, tag, (content, steps, _) in self._select(run_tag_filter):
            result.setdefault(run, {})[tag] = provider.ScalarTimeSeries(
                max_step=int(steps[-1]), max_wall_time=0.0, plugin_content=content,
                description="", display_name="")
        return result

    def read_scalars(self, ctx=None, *, experiment_id, plugin_name, downsample=None, run_tag_filter=None):
        result = {}
        for run, tag, (_, steps, values) in self._select(run_tag_filter):
            keep = np.linspace(0, len(steps) - 1, min(downsample, len(steps))).astype(int)
            result.setdefault(run, {})[tag] = [
                provider.ScalarDatum(step=int(steps[i]), wall_time=0.0, value=float(values[i]))
                for i in keep]
        return result

    def read_last_scalars(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        return {run: {tag: provider.ScalarDatum(step=int(steps[-1]), wall_time=0.0, value=float(values[-1]))
                      for tag, (_, steps, values) in tags.items()}
                for run, tags in self._runs.items()
                if not (run_tag_filter and run_tag_filter.runs and run not in run_tag_filter.runs)}

    def list_tensors(self, *args, **kwargs):
        return {}

    def read_tensors(self, *args, **kwargs):
        return {}

    def list_blob_sequences(self, *args, **kwargs):
        return {}

    def read_blob_sequences(self, *args, **kwargs):
        return {}

    def read_blob(self, *args, **kwargs):
        raise NotImplementedError


def make_runs(runs, updates, variables, seed=0):
    rng = np.random.default_rng(seed)
    steps = np.arange(1, updates + 1)
    result = {}
    for r in range(runs):
        tags = {}
        for name, kind in metadata.UPDATE_SERIES:
            content = metadata.create_summary_metadata(kind).plugin_data.content
            tags[metadata.TAG_PREFIX + name] = (content, steps, rng.random(updates))
        for v in range(variables):
            content = metadata.create_summary_metadata(
                metadata.Kind.ACCUMULATOR_NORM, variable=f"layer_{v}/kernel").plugin_data.content
            tags[f"{metadata.ACCUMULATOR_PREFIX}layer_{v}/kernel"] = (content, steps, rng.random(updates))
        event_steps = steps[::max(1, updates // 100)]
        for name, kind in metadata.LEFTOVER_SERIES:
            content = metadata.create_summary_metadata(kind).plugin_data.content
            tags[metadata.TAG_PREFIX + name] = (content, event_steps, np.ones(len(event_steps)))
        result[f"run-{r}"] = tags
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--updates", type=int, default=100_000)
    parser.add_argument("--variables", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = InMemoryProvider(make_runs(args.runs, args.updates, args.variables))
    for label, hints in (("default retention", {}), ("samples_per_plugin=accumulation=0", {"accumulation": 0})):
        plugin = AccumulationPlugin(base_plugin.TBContext(data_provider=data, sampling_hints=hints))
        timings = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            runs = plugin.runs_impl(None, "")["runs"]
            for run in runs:
                plugin.series_impl(None, "", run["run"])
                plugin.events_impl(None, "", run["run"])
            timings.append(time.perf_counter() - start)
        print(f"{args.runs} runs x {args.updates} updates, {label}: "
              f"{statistics.median(timings):.3f} s for the runs list and every run's series and events")


if __name__ == "__main__":
    main()
