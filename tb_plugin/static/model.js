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

/**
 * {runs: [{run, updates, variables, problems}] sorted by name, vocabulary}: the
 * vocabulary (leftover policies, their labels, the advisor's band) is defined
 * once, in Python (tb_plugin/metadata.py), and read from here.
 */
export async function fetchRuns() {
  const {runs, vocabulary} = await getJson('./runs');
  return {runs, vocabulary};
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
    noise: column('noise_scale'),
    samples: column('window_samples'),
    loss: column('window_loss'),
    // The effective batch in the unit windows are weighted by: the items
    // (tokens) a masked loss averages over, else samples (older runs).
    batch: effectiveBatch(column('window_items'), column('window_samples')),
    microBatches: column('window_micro_batches'),
    heat: {
      variables: heat.variables,
      columns: heat.columns,
      values: heat.values.map((row) => row.map(toNumber)),
    },
    // The advisor's rule is the server's (tb_plugin/metadata.py run_advice).
    advice: adviceOf(series.advice),
    events: events.events,
    counters: events.counters,
    // What the server skipped for this run (see http_api.md), once each.
    problems: [...new Set([...(series.problems || []), ...(events.problems || [])]
      .map((p) => p.reason))],
  };
}

const usable = (v) => Number.isFinite(v) && v > 0;

function effectiveBatch(items, samples) {
  return items.some(usable) ? items : samples;
}

/**
 * The advisor's verdict the series route computed (snake_case JSON), as the
 * page reads it: {advice: 'less' | 'more' | 'good' | 'unknown', suggestedSteps,
 * noiseScale, batch, microBatch, accumulation, step, lastStep} (numbers or null).
 */
function adviceOf(a) {
  return {
    advice: a.advice,
    suggestedSteps: toNumber(a.suggested_steps),
    noiseScale: toNumber(a.noise_scale),
    batch: toNumber(a.batch),
    microBatch: toNumber(a.micro_batch),
    accumulation: toNumber(a.accumulation),
    step: toNumber(a.step),
    lastStep: toNumber(a.last_step),
  };
}
