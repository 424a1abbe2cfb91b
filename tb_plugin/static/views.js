// DOM building only. Run and variable names are data: they go in with
// textContent (via `el`), never as HTML.

import {formatNumber, legendIcon} from './charts.js';

const STYLE = `
  body { margin: 0; background: #fff; }
  #accumulation-dashboard { font: 13px/1.45 Roboto, system-ui, sans-serif; color: #212121;
    padding: 16px 20px 32px; max-width: 1100px; }
  #accumulation-dashboard h1 { font-size: 18px; font-weight: 500; margin: 0; }
  #accumulation-dashboard h2 { font-size: 14px; font-weight: 500; margin: 0 0 8px; }
  .acc-header { display: flex; align-items: center; gap: 16px; margin-bottom: 12px; }
  .acc-header button { margin-left: auto; }
  button, select { font: inherit; }
  section.card { border: 1px solid #e0e0e0; border-radius: 6px; padding: 12px 14px;
    margin: 12px 0; }
  .runs { display: flex; flex-wrap: wrap; gap: 6px 18px; align-items: center; }
  .runs label { display: inline-flex; align-items: center; gap: 5px; cursor: pointer;
    white-space: pre; }
  .swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
    margin-right: 5px; flex: none; }
  .status:empty { display: none; }
  .status { padding: 8px 12px; border-radius: 4px; background: #f5f5f5; margin: 8px 0; }
  .status.error { background: #fdecea; color: #b71c1c; }
  .legend { display: flex; flex-wrap: wrap; gap: 4px 16px; align-items: center; color: #555;
    margin-top: 4px; }
  .legend span { display: inline-flex; align-items: center; gap: 4px; }
  .toolbar { display: flex; align-items: center; gap: 16px; margin-bottom: 6px; color: #555; }
  .note { color: #757575; font-size: 12px; }
  .chart { position: relative; }
  svg text { font: 11px Roboto, system-ui, sans-serif; fill: #616161; }
  svg .axis-label { fill: #424242; }
  svg .axis, svg .tick { stroke: #9e9e9e; }
  svg .grid { stroke: #eeeeee; }
  svg .applied { fill: none; stroke-width: 2; stroke-linejoin: round; stroke-linecap: round; }
  svg .loss { fill: none; stroke-width: 2; stroke-linejoin: round; stroke-linecap: round; }
  svg .micro { fill: none; stroke-width: 1.3; opacity: 0.45; stroke-linecap: round; }
  svg .noise-scale { fill: none; stroke-width: 2.2; stroke-linejoin: round; stroke-linecap: round; }
  svg .effective-batch { fill: none; stroke-width: 1.5; opacity: 0.8; stroke-linecap: round; }
  svg .guide { stroke: #bdbdbd; stroke-dasharray: 3 3; }
  svg .overlay { fill: transparent; }
  svg .marker { cursor: default; }
  svg .frame { fill: none; stroke: #e0e0e0; }
  svg .row-label { fill: #424242; }
  .line-chart, .heat { width: 100%; height: auto; display: block; }
  .tooltip { position: absolute; pointer-events: none; background: rgba(33,33,33,0.92);
    color: #fff; padding: 6px 8px; border-radius: 4px; font-size: 12px; white-space: pre;
    z-index: 1; }
  table.counters { border-collapse: collapse; width: 100%; }
  table.counters th, table.counters td { padding: 5px 10px; border-bottom: 1px solid #eee;
    text-align: right; }
  table.counters th:first-child, table.counters td:first-child { text-align: left;
    white-space: pre; }
  table.counters th { font-weight: 500; color: #616161; }
  .intro { margin: 0 0 8px; color: #424242; max-width: 900px; }
  ul.hints { list-style: none; padding: 0; margin: 10px 0 0; }
  ul.hints li { margin: 6px 0; padding: 6px 10px; background: #fafafa; border-radius: 4px; }
  ul.hints .run-name { font-weight: 500; white-space: pre; }
  ul.hints .verdict { font-weight: 500; }
  ul.problems { margin: 4px 0 0; padding-left: 18px; }
  ul.problems li { margin: 3px 0; color: #8a4b00; overflow-wrap: anywhere; }
  .problem-run { font-weight: 500; white-space: pre; }
  #empty-state { max-width: 640px; }
  #empty-state pre { background: #f5f5f5; padding: 10px 12px; border-radius: 4px;
    overflow-x: auto; }
`;

/** Creates an element; string children become text nodes, never HTML. */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === 'dataset') Object.assign(node.dataset, value);
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else if (key in node) node[key] = value;
    else node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function swatch(color) {
  const s = el('span', {className: 'swatch'});
  s.style.background = color;
  return s;
}

/** The page skeleton; returns its parts for index.js to fill. */
export function mount(onReload) {
  document.head.append(el('style', {}, STYLE));
  const status = el('div', {className: 'status', role: 'status'});
  const controls = el('div');
  const content = el('div');
  const root = el('div', {id: 'accumulation-dashboard'},
    el('div', {className: 'acc-header'},
      el('h1', {}, 'Gradient accumulation'),
      el('button', {type: 'button', onclick: onReload, title: 'Read the logs again'}, 'Reload')),
    status, controls, content);
  document.body.append(root);
  return {root, status, controls, content};
}

export function setStatus(ui, message, isError = false) {
  ui.status.textContent = message;
  ui.status.classList.toggle('error', isError);
  ui.status.setAttribute('role', isError ? 'alert' : 'status');
}

export function emptyState() {
  return el('div', {id: 'empty-state'},
    el('h2', {}, 'No accumulation data was found'),
    el('p', {}, 'None of the runs in this log directory has summaries from tfaccum. ' +
      'Pass a log_dir to the callback when you train:'),
    el('pre', {}, 'from tfaccum import GradientAccumulationCallback\n\n' +
      'model.fit(x, y, batch_size=8, epochs=3, callbacks=[\n' +
      '    GradientAccumulationCallback(accumulation_steps=4, log_dir="logs/run-a"),\n])'),
    el('p', {}, 'then point TensorBoard at the parent directory and press Reload:'),
    el('pre', {}, 'tensorboard --logdir logs'));
}

/** Checkboxes, one per run, coloured like the run's line. */
export function runSelector(runs, selected, colorOf, onChange) {
  const boxes = runs.map(({run, updates}) => el('label',
    {dataset: {run}, title: `${updates} updates`},
    el('input', {type: 'checkbox', checked: selected.has(run), dataset: {run},
      onchange: (e) => onChange(run, e.target.checked)}),
    swatch(colorOf(run)), run));
  return el('section', {className: 'card'},
    el('h2', {}, 'Runs'), el('div', {className: 'runs'}, ...boxes));
}

export function card(title, ...children) {
  return el('section', {className: 'card'}, el('h2', {}, title), ...children);
}

export function normsSection(chart, {showMicro, onToggleMicro, notes, vocabulary}) {
  const legend = el('div', {className: 'legend'},
    el('span', {}, legendIcon('applied'), 'applied gradient norm'),
    showMicro ? el('span', {}, legendIcon('mean'), 'micro-batch mean') : null,
    showMicro ? el('span', {}, legendIcon('max'), 'micro-batch max') : null,
    ...vocabulary.leftover_policies.map((p) =>
      el('span', {}, legendIcon(p), vocabulary.leftover_labels[p] || p)),
    el('span', {}, legendIcon('nonfinite'), 'non-finite value (NaN / ±Infinity)'));
  const toggle = el('label', {},
    el('input', {type: 'checkbox', checked: showMicro, id: 'show-micro',
      onchange: (e) => onToggleMicro(e.target.checked)}),
    ' show micro-batch mean / max norms');
  return card('Applied gradient norm per optimizer update',
    el('div', {className: 'toolbar'}, toggle,
      ...notes.map((n) => el('span', {className: 'note'}, n))),
    chart, legend);
}

export function heatSection(runs, current, onSelect, chart, empty) {
  const select = el('select', {id: 'heat-run', onchange: (e) => onSelect(e.target.value)},
    ...runs.map((run) => el('option', {value: run}, run)));
  select.value = current;
  return card('Accumulator norm per variable (largest per update range, log colour scale)',
    el('div', {className: 'toolbar'}, el('label', {}, 'Run ', select)),
    empty ? el('p', {className: 'note'}, 'This run has no per-variable norms.') : chart);
}

const PAPER = 'https://arxiv.org/abs/1812.06162';

const VERDICTS = {
  less: 'Accumulate less.',
  more: 'Accumulate more.',
  good: 'Good trade-off.',
  unknown: 'No advice yet.',
};

/** The plain-language hint for one run's advice (the series route's): [verdict, details]. */
export function adviceText(a) {
  const verdict = VERDICTS[a.advice];
  const n = formatNumber(a.noiseScale);
  if (a.noiseScale === null) {
    return [verdict, 'There is no estimate of B_simple yet: it needs windows of at least two ' +
      'micro-batches (accumulation_steps >= 2) and some updates.'];
  }
  if (a.advice === 'unknown') {
    return [verdict, `B_simple ≈ ${n}, but no update logged its effective batch.`];
  }
  const ratio = formatNumber(Number((a.batch / a.noiseScale).toPrecision(2)));
  let out = `The effective batch B = ${formatNumber(a.batch)} per update ` +
    `(${formatNumber(a.accumulation)} micro-batches of ${formatNumber(a.microBatch)}) ` +
    `is ${ratio}× B_simple ≈ ${n}. `;
  const k = a.suggestedSteps;
  const then = `accumulation_steps = ${k} would make B ≈ ${formatNumber(k * a.microBatch)}.`;
  if (a.advice === 'less') {
    out += 'Well above the noise scale, the examples needed grow like 1 + B/B_noise while ' +
      'the number of updates barely falls: most of the extra compute per update is wasted; ' +
      then;
    if (k * a.microBatch > 2 * a.noiseScale) {
      out += ' Even one micro-batch is above B_simple: a smaller micro-batch would get closer.';
    }
  } else if (a.advice === 'more') {
    out += 'Below the noise scale, a larger batch costs few extra examples and cuts the ' +
      'number of updates (and, across devices, of all-reduces); ' + then;
  } else {
    out += 'It is near the critical batch size: a good trade-off between the number of ' +
      'updates and the examples they cost.';
  }
  if (a.step !== a.lastStep) {
    out += ` (B is that of update ${a.step}: the partial window flushed at update ` +
      `${a.lastStep} is left out.)`;
  }
  return [verdict, out];
}

/**
 * The window-loss card: the loss each update's window reports, weighted as
 * its gradient, which is the loss the large batch would have shown.
 */
export function lossSection(chart) {
  return card('Window loss per optimizer update',
    el('p', {className: 'intro'},
      'The loss of each applied window, its micro-batches weighted as their gradients ' +
      '(by samples, or by unmasked tokens): the loss a run at the large batch reports, ' +
      'update for update. The progress bar shows micro-batch losses instead.'),
    chart);
}

/**
 * The batch-size advisor card: the chart, its legend and one hint per run.
 * rows: [{run, color, advice}] with the series route's advice. Each hint
 * carries data-hint-run, data-advice ("less", "more", "good" or "unknown"),
 * data-suggested-steps, data-noise-scale and data-batch ("" when unknown).
 */
export function advisorSection(chart, rows, {nonFinite = false} = {}) {
  const intro = el('p', {className: 'intro'},
    'B_simple, the gradient noise scale of McCandlish, Kaplan, Amodei et al. (2018), ',
    el('a', {href: PAPER, target: '_blank', rel: 'noopener noreferrer'},
      '“An Empirical Model of Large-Batch Training”'),
    ', estimates the critical batch size: at batch size B, training takes about ' +
    'S = S_min (1 + B_noise/B) updates and E = E_min (1 + B/B_noise) examples. ' +
    'The effective batch B is what one optimizer update averages over (micro-batch × ' +
    'accumulation_steps): its samples, or its unmasked tokens where a mask or ' +
    'ignore_class reaches the loss; B_simple is then in tokens too.');
  const legend = el('div', {className: 'legend'},
    el('span', {}, legendIcon('noise-scale'), 'gradient noise scale B_simple'),
    el('span', {}, legendIcon('effective-batch'), 'effective batch B (samples or tokens per update)'),
    nonFinite ? el('span', {}, legendIcon('nonfinite'), 'non-finite B_simple') : null);
  const hints = rows.map(({run, color, advice}) => {
    const [verdict, details] = adviceText(advice);
    return el('li', {dataset: {
      hintRun: run,
      advice: advice.advice,
      suggestedSteps: advice.suggestedSteps === null ? '' : String(advice.suggestedSteps),
      noiseScale: advice.noiseScale === null ? '' : String(advice.noiseScale),
      batch: advice.batch === null ? '' : String(advice.batch),
    }}, swatch(color), el('span', {className: 'run-name'}, run), ': ',
    el('span', {className: 'verdict'}, verdict), ' ', details);
  });
  return card('Batch-size advisor: gradient noise scale vs. effective batch size',
    intro, chart, legend, el('ul', {className: 'hints'}, ...hints));
}

const COUNTERS = [
  ['optimizer_steps', 'Optimizer updates'],
  ['micro_steps', 'Micro-steps'],
  ['skipped_updates', 'Skipped updates'],
  ['nonfinite_skips', 'Non-finite skips'],
  ['flushes', 'Flushes'],
  ['carries', 'Carries'],
  ['dropped_micro_steps', 'Dropped micro-steps'],
];

/** rows: [{run, color, counters}]; null counters show as "—". */
export function countersTable(rows) {
  const head = el('tr', {}, el('th', {}, 'Run'),
    ...COUNTERS.map(([, label]) => el('th', {}, label)));
  const body = rows.map(({run, color, counters}) => el('tr', {dataset: {run}},
    el('td', {}, swatch(color), run),
    ...COUNTERS.map(([key]) => {
      const value = counters[key];
      const shown = value === null || value === undefined ? '—' : String(value);
      return el('td', {dataset: {counter: key}}, shown);
    })));
  return card('Counters (latest values per run)',
    el('table', {className: 'counters'}, el('thead', {}, head), el('tbody', {}, ...body)));
}

/**
 * What could not be read, per run: rows [{run, color, reasons}]. The runs
 * listed here still draw everything else they hold.
 */
export function problemsSection(rows) {
  const items = rows.map(({run, color, reasons}) => el('li', {dataset: {problemRun: run}},
    el('div', {className: 'problem-run'}, swatch(color), run),
    el('ul', {className: 'problems'},
      ...reasons.map((reason) => el('li', {dataset: {problem: ''}}, reason)))));
  return card('Not shown: what could not be read',
    el('p', {className: 'note'}, 'These values or runs were skipped; every other run ' +
      'is drawn as usual.'),
    el('ul', {className: 'problems'}, ...items));
}
