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
 * Batch-size advice for one run (a fetchRun result), from the gradient noise
 * scale B_simple of McCandlish et al. (2018). Training to a given loss takes
 * S = S_min (1 + B_noise / B) updates and E = E_min (1 + B / B_noise) examples
 * at batch size B, so B well above B_noise wastes examples and B well below it
 * wastes updates.
 *
 * B_simple: the run's last defined estimate (null entries, and NaN, ±Infinity
 * or non-positive ones, are passed over). B: the effective batch (window_items,
 * or window_samples where the run has none)
 * of the run's last update, leaving out an update that flushed a partial window
 * at an epoch's or fit's end (unless every update did): its window is shorter
 * than the run's accumulation_steps says. The micro-batch size is that window's
 * samples / micro-batches, and the suggestion the accumulation_steps that makes
 * B ≈ B_simple: max(1, round(B_simple / micro-batch)). "less" above `band`
 * times B_simple, "more" below B_simple / `band` (vocabulary.advice_band).
 *
 * Returns {advice: 'less' | 'more' | 'good' | 'unknown', suggestedSteps
 * (null when unknown), noiseScale, batch, microBatch, accumulation, step,
 * lastStep} (numbers or null).
 */
export function batchAdvice({steps, noise, batch: samples, microBatches, events}, {advice_band: band}) {
  let noiseScale = null;
  for (let i = noise.length - 1; i >= 0; i -= 1) {
    if (usable(noise[i])) {
      noiseScale = noise[i];
      break;
    }
  }
  const flushed = new Set(events.filter((e) => e.policy === 'flush').map((e) => e.step));
  let at = -1;
  let last = -1;
  for (let i = steps.length - 1; i >= 0 && at < 0; i -= 1) {
    if (!usable(samples[i]) || !usable(microBatches[i])) continue;
    if (last < 0) last = i;
    if (!flushed.has(steps[i])) at = i;
  }
  if (at < 0) at = last;
  const result = {advice: 'unknown', suggestedSteps: null, noiseScale, batch: null,
    microBatch: null, accumulation: null, step: null,
    lastStep: steps.length ? steps[steps.length - 1] : null};
  if (at < 0) return result;
  const batch = samples[at];
  Object.assign(result, {batch, microBatch: batch / microBatches[at],
    accumulation: microBatches[at], step: steps[at]});
  if (noiseScale === null) return result;
  // Math.round rounds halves up, as metadata.suggested_accumulation_steps does.
  result.suggestedSteps = Math.max(1, Math.round(noiseScale / result.microBatch));
  if (batch > band * noiseScale) result.advice = 'less';
  else if (batch < noiseScale / band) result.advice = 'more';
  else result.advice = 'good';
  return result;
}
