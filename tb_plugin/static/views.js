// DOM building only. Run and variable names are data: they go in with
// textContent (via `el`), never as HTML.

import {legendIcon, POLICY_STYLE} from './charts.js';

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
  svg .micro { fill: none; stroke-width: 1.3; opacity: 0.45; stroke-linecap: round; }
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

export function normsSection(chart, {showMicro, onToggleMicro, notes}) {
  const legend = el('div', {className: 'legend'},
    el('span', {}, legendIcon('applied'), 'applied gradient norm'),
    showMicro ? el('span', {}, legendIcon('mean'), 'micro-batch mean') : null,
    showMicro ? el('span', {}, legendIcon('max'), 'micro-batch max') : null,
    ...['flush', 'carry', 'drop'].map((p) =>
      el('span', {}, legendIcon(p), POLICY_STYLE[p].label)),
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
