// Data access: the plugin's JSON routes (see http_api.md), relative to the
// iframe document, whose <base> is /data/plugin/accumulation/.

async function getJson(url) {
  const response = await fetch(url, {headers: {Accept: 'application/json'}});
  if (!response.ok) {
    const message = (await response.text().catch(() => '')).trim();
    throw new Error(`${response.status} ${message || response.statusText}`);
  }
  return response.json();
}

/** null stays null; numbers and "NaN" / "Infinity" / "-Infinity" become numbers. */
export const toNumber = (v) => (v === null || v === undefined ? null : Number(v));

/** [{run, updates, variables}], sorted by name. */
export async function fetchRuns() {
  const {runs} = await getJson('./runs');
  return runs;
}

const cache = new Map(); // run -> Promise of fetchRun's result

export function clearCache() {
  cache.clear();
}

/** Series, heat map, leftover events and counters of one run (cached). */
export function fetchRun(run) {
  if (!cache.has(run)) {
    const query = `run=${encodeURIComponent(run)}`;
    const pending = Promise.all([getJson(`./series?${query}`), getJson(`./events?${query}`)])
      .then(([series, events]) => normalize(run, series, events));
    // A failed fetch is retried the next time rather than cached.
    pending.catch(() => cache.get(run) === pending && cache.delete(run));
    cache.set(run, pending);
  }
  return cache.get(run);
}

function normalize(run, series, events) {
  const column = (name) => (series.series[name] || []).map(toNumber);
  const heat = series.accumulators;
  return {
    run,
    steps: series.steps,
    sampled: series.sampled,
    applied: column('applied_gradient_norm'),
    mean: column('micro_norm_mean'),
    max: column('micro_norm_max'),
    heat: {
      variables: heat.variables,
      columns: heat.columns,
      values: heat.values.map((row) => row.map(toNumber)),
    },
    events: events.events,
    counters: events.counters,
  };
}
