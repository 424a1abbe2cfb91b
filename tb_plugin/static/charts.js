// SVG drawing: the applied-gradient-norm line chart, the batch-size chart (noise
// scale and effective batch, log scale) and the accumulator heat map.
// Data never goes through innerHTML: every label is set with textContent.

const SVG_NS = 'http://www.w3.org/2000/svg';

// Colours of the leftover policies (their names and labels come from the
// plugin's vocabulary); an unknown policy is drawn as a black cross.
const POLICY_COLOR = {flush: '#00897b', carry: '#f29900', drop: '#d81b60'};
export const NONFINITE_COLOR = '#e53935';
const EFFECTIVE_BATCH_DASH = '6 4';
const HEAT_STOPS = ['#440154', '#414487', '#2a788e', '#22a884', '#7ad151', '#fde725'];

/** Creates an SVG element; `title` adds a <title> child (a native tooltip). */
export function svg(tag, attrs = {}, title = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  if (title !== null) {
    const t = document.createElementNS(SVG_NS, 'title');
    t.textContent = title;
    node.append(t);
  }
  return node;
}

function text(content, attrs) {
  const node = svg('text', attrs);
  node.textContent = content;
  return node;
}

export function formatNumber(v) {
  if (v === null || v === undefined) return '—';
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Number(v.toPrecision(4)));
}

const finite = (v) => typeof v === 'number' && Number.isFinite(v);

/** [min, max] of an array of numbers (no spread: arrays can be long); null if empty. */
function extent(values) {
  if (!values.length) return null;
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  return [lo, hi];
}

function scale(d0, d1, r0, r1) {
  const k = d1 === d0 ? 0 : (r1 - r0) / (d1 - d0);
  const f = (v) => r0 + (v - d0) * k;
  f.invert = (r) => (k === 0 ? d0 : d0 + (r - r0) / k);
  return f;
}

function ticks(lo, hi, count, integer = false) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    out.push(Number(v.toPrecision(12)));
  }
  return out;
}

/** Index of the step nearest to `x` in the sorted array `steps`. */
function nearest(steps, x) {
  let lo = 0;
  let hi = steps.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (steps[mid] < x) lo = mid; else hi = mid;
  }
  return Math.abs(steps[lo] - x) <= Math.abs(steps[hi] - x) ? lo : hi;
}

/** The line's value at `step`: its point there, or between its neighbours. */
function valueAt(steps, values, step) {
  if (!steps.length) return null;
  let i = nearest(steps, step);
  if (steps[i] === step) return values[i];
  if (steps[i] < step) i += 1;
  const [a, b] = [i - 1, i];
  if (a < 0 || b >= steps.length || !finite(values[a]) || !finite(values[b])) return null;
  return values[a] + ((values[b] - values[a]) * (step - steps[a])) / (steps[b] - steps[a]);
}

/** Path data through the finite values; null and non-finite values leave gaps. */
function linePath(steps, values, x, y) {
  let d = '';
  let drawn = 0;
  let open = false;
  values.forEach((v, i) => {
    if (!finite(v)) {
      open = false;
      return;
    }
    const point = `${x(steps[i]).toFixed(1)},${y(v).toFixed(1)}`;
    // `h0` makes a lone point (between gaps) visible as a round dot.
    d += open ? `L${point}` : `M${point}h0`;
    open = true;
    drawn += 1;
  });
  return {d, drawn};
}

/** A marker shape for a leftover policy, centred on (cx, cy). */
export function policyMarker(policy, cx, cy, title = null) {
  const color = POLICY_COLOR[policy] || '#000';
  const common = {class: `marker marker-${policy}`, stroke: '#fff', 'stroke-width': 1.5};
  if (policy === 'flush') return svg('circle', {...common, cx, cy, r: 5.5, fill: color}, title);
  if (policy === 'carry') {
    const s = 6.5;
    const d = `M${cx},${cy - s}L${cx + s},${cy}L${cx},${cy + s}L${cx - s},${cy}Z`;
    return svg('path', {...common, d, fill: color}, title);
  }
  // drop (and anything unknown): a cross, with a white halo for contrast.
  const s = 5;
  const d = `M${cx - s},${cy - s}L${cx + s},${cy + s}M${cx - s},${cy + s}L${cx + s},${cy - s}`;
  const g = svg('g', {class: `marker marker-${policy}`}, title);
  g.append(svg('path', {d, stroke: '#fff', 'stroke-width': 5, 'stroke-linecap': 'round'}));
  g.append(svg('path', {d, stroke: color, 'stroke-width': 2.5, 'stroke-linecap': 'round'}));
  return g;
}

/** A triangle marking a non-finite value: at the top (NaN, +Inf) or bottom (-Inf). */
export function nonFiniteMarker(cx, cy, down, title = null) {
  const s = 6;
  const d = down
    ? `M${cx - s},${cy - s}L${cx + s},${cy - s}L${cx},${cy + s * 0.6}Z`
    : `M${cx - s},${cy + s}L${cx + s},${cy + s}L${cx},${cy - s * 0.6}Z`;
  return svg('path', {class: 'marker marker-nonfinite', d, fill: NONFINITE_COLOR}, title);
}

/**
 * One run's non-finite `values` as a group of markers (counted in data-count):
 * NaN and +Inf at `topY`, -Inf at `bottomY`; each titled with its update.
 */
function nonFiniteMarkers(className, r, values, label, x, topY, bottomY) {
  const group = svg('g', {class: className, 'data-run': r.run});
  let count = 0;
  values.forEach((v, i) => {
    if (v === null || finite(v)) return;
    const down = v === -Infinity;
    group.append(nonFiniteMarker(x(r.steps[i]), down ? bottomY : topY, down,
      `${r.run}\nupdate ${r.steps[i]}: ${label} ${v}`));
    count += 1;
  });
  group.setAttribute('data-count', count);
  return group;
}

/** A small inline SVG icon for legends: a line style or a marker. */
export function legendIcon(kind, color = '#555') {
  const icon = svg('svg', {width: 22, height: 14, viewBox: '0 0 22 14', 'aria-hidden': 'true'});
  const dash = {mean: '5 3', max: '1.5 2.5', 'effective-batch': EFFECTIVE_BATCH_DASH}[kind];
  const solid = kind === 'applied' || kind === 'noise-scale';
  if (solid || dash) {
    icon.append(svg('line', {x1: 1, y1: 7, x2: 21, y2: 7, stroke: color,
      'stroke-width': solid ? 2.5 : 1.5, 'stroke-dasharray': dash}));
  } else if (kind === 'nonfinite') {
    icon.append(nonFiniteMarker(11, 8, false));
  } else {
    icon.append(policyMarker(kind, 11, 7));
  }
  return icon;
}

/** The x axis (optimizer updates, integer ticks), both axis lines and their labels. */
function updateAxis(axes, x, [x0, x1], m, W, H, yLabel) {
  for (const t of ticks(x0, x1, 8, true)) {
    axes.append(svg('line', {class: 'tick', x1: x(t), x2: x(t), y1: H - m.bottom,
      y2: H - m.bottom + 5}));
    axes.append(text(String(t), {x: x(t), y: H - m.bottom + 18, 'text-anchor': 'middle'}));
  }
  axes.append(svg('line', {class: 'axis', x1: m.left, x2: W - m.right, y1: H - m.bottom,
    y2: H - m.bottom}));
  axes.append(svg('line', {class: 'axis', x1: m.left, x2: m.left, y1: m.top, y2: H - m.bottom}));
  axes.append(text('optimizer update', {class: 'axis-label', x: (m.left + W - m.right) / 2,
    y: H - 6, 'text-anchor': 'middle'}));
  axes.append(text(yLabel, {class: 'axis-label', 'text-anchor': 'middle',
    transform: `translate(14 ${(m.top + H - m.bottom) / 2}) rotate(-90)`}));
}

/**
 * One per-update series of several runs, overlaid (one colour per run), with
 * leftover-event markers, a hover read-out and, for the applied gradient
 * norm, optional micro-batch mean/max lines. `runs`: [{run, color, steps,
 * applied, mean, max, events, ...}]; `value` names the series drawn.
 * Returns a <div> holding the <svg> and its tooltip.
 */
export function lineChart(runs, {showMicro = true, value = 'applied', axis = 'gradient norm',
  title = 'Applied gradient norm per optimizer update'} = {}) {
  showMicro = showMicro && value === 'applied';
  const W = 900;
  const H = 320;
  const m = {left: 58, right: 18, top: 16, bottom: 42};
  const xs = [];
  const ys = [];
  for (const r of runs) {
    for (const step of r.steps) xs.push(step);
    for (const e of r.events) xs.push(e.step);
    const lines = showMicro ? [r[value], r.mean, r.max] : [r[value]];
    for (const line of lines) for (const v of line) if (finite(v)) ys.push(v);
  }
  let [x0, x1] = extent(xs) || [0, 1];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  const [yMin, yMax] = extent(ys) || [0, 1];
  const y0 = Math.min(0, yMin);
  let y1 = yMax;
  if (y1 <= y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const x = scale(x0, x1, m.left, W - m.right);
  const y = scale(y0, y1, H - m.bottom, m.top);

  const root = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'line-chart', role: 'img',
    'aria-label': title, 'data-series': value});
  const axes = svg('g', {class: 'axes'});
  for (const t of ticks(y0, y1, 6)) {
    axes.append(svg('line', {class: 'grid', x1: m.left, x2: W - m.right, y1: y(t), y2: y(t)}));
    axes.append(text(formatNumber(t), {x: m.left - 6, y: y(t) + 4, 'text-anchor': 'end'}));
  }
  updateAxis(axes, x, [x0, x1], m, W, H, axis);
  root.append(axes);

  for (const r of runs) {
    const g = svg('g', {class: 'run', 'data-run': r.run});
    if (showMicro) {
      for (const [name, values, dash] of [['mean', r.mean, '5 3'], ['max', r.max, '1.5 2.5']]) {
        const {d} = linePath(r.steps, values, x, y);
        g.append(svg('path', {class: `micro micro-${name}`, d, stroke: r.color,
          'stroke-dasharray': dash, 'data-run': r.run}));
      }
    }
    const {d, drawn} = linePath(r.steps, r[value], x, y);
    g.append(svg('path', {class: value, d, stroke: r.color, 'data-run': r.run,
      'data-points': drawn}));

    const main = value === 'applied';
    g.append(nonFiniteMarkers(main ? 'nonfinite' : `${value}-nonfinite`, r, r[value], axis, x,
      m.top + 7, H - m.bottom - 7));
    if (!main) {
      root.append(g);
      continue; // leftover markers belong to the gradient-norm chart
    }

    const marks = svg('g', {class: 'events', 'data-run': r.run, 'data-markers': r.events.length});
    for (const e of r.events) {
      const v = valueAt(r.steps, r[value], e.step);
      const cy = finite(v) ? y(v) : H - m.bottom; // on the line, else on the x axis
      marks.append(policyMarker(e.policy, x(e.step), cy,
        `${r.run}\nupdate ${e.step}: ${e.policy} of a partial window ` +
        `(${e.micro_batches} micro-batches, ${e.samples} samples)`));
    }
    g.append(marks);
    root.append(g);
  }

  return withHover(root, runs, x, m, W, H, (r, i) => {
    let label = `${r.run} · update ${r.steps[i]}: ${formatNumber(r[value][i])}`;
    if (showMicro) label += ` (mean ${formatNumber(r.mean[i])}, max ${formatNumber(r.max[i])})`;
    return label;
  });
}

/**
 * Wraps a chart's <svg> in a <div> with a hover read-out: a vertical guide at
 * the nearest update and one line per run, `label(run, index)` (plain text).
 */
function withHover(root, runs, x, m, W, H, label) {
  const wrap = document.createElement('div');
  wrap.className = 'chart';
  const tip = document.createElement('div');
  tip.className = 'tooltip';
  tip.hidden = true;
  const guide = svg('line', {class: 'guide', y1: m.top, y2: H - m.bottom, visibility: 'hidden'});
  const overlay = svg('rect', {class: 'overlay', x: m.left, y: m.top,
    width: W - m.left - m.right, height: H - m.top - m.bottom});
  root.append(guide, overlay);
  overlay.addEventListener('pointermove', (event) => {
    const ctm = root.getScreenCTM();
    if (!ctm) return;
    const p = new DOMPoint(event.clientX, event.clientY).matrixTransform(ctm.inverse());
    const step = x.invert(p.x);
    tip.replaceChildren();
    let shown = null;
    for (const r of runs) {
      if (!r.steps.length) continue;
      const i = nearest(r.steps, step);
      shown ??= r.steps[i];
      const line = document.createElement('div');
      const swatch = document.createElement('span');
      swatch.className = 'swatch';
      swatch.style.background = r.color;
      line.append(swatch, document.createTextNode(label(r, i)));
      tip.append(line);
    }
    if (shown === null) return;
    guide.setAttribute('x1', x(shown));
    guide.setAttribute('x2', x(shown));
    guide.setAttribute('visibility', 'visible');
    const box = wrap.getBoundingClientRect();
    tip.hidden = false;
    const left = event.clientX - box.left + 14;
    tip.style.left = `${Math.min(left, box.width - tip.offsetWidth - 4)}px`;
    tip.style.top = `${event.clientY - box.top + 14}px`;
  });
  overlay.addEventListener('pointerleave', () => {
    tip.hidden = true;
    guide.setAttribute('visibility', 'hidden');
  });
  wrap.append(root, tip);
  return wrap;
}

/** Ticks of a log axis: 1-2-5 per decade over a short range, powers of ten beyond. */
function logTicks(lo, hi) {
  const mults = Math.log10(hi / lo) <= 2.5 ? [1, 2, 5] : [1];
  const out = [];
  for (let p = Math.floor(Math.log10(lo)) - 1; p <= Math.ceil(Math.log10(hi)) + 1; p += 1) {
    for (const k of mults) out.push(Number((k * 10 ** p).toPrecision(12)));
  }
  return out;
}

/**
 * The gradient noise scale B_simple (solid) and the effective batch size B
 * (dashed) of several runs on one log-scale axis, one colour per run.
 * `runs`: [{run, color, steps, noise, batch}]. Null, non-finite and
 * non-positive values leave gaps (a log axis has no place for them);
 * non-finite noise-scale values get a marker, as on the gradient-norm chart.
 */
export function batchSizeChart(runs) {
  const W = 900;
  const H = 300;
  const m = {left: 58, right: 18, top: 16, bottom: 42};
  const positive = (v) => finite(v) && v > 0;
  const log = (values) => values.map((v) => (positive(v) ? Math.log10(v) : null));
  const xs = [];
  const ys = [];
  for (const r of runs) {
    for (const step of r.steps) xs.push(step);
    for (const line of [r.noise, r.batch]) for (const v of line) if (positive(v)) ys.push(v);
  }
  let [x0, x1] = extent(xs) || [0, 1];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  let [lo, hi] = extent(ys) || [1, 10];
  if (lo === hi) [lo, hi] = [lo / 2, hi * 2];
  // Widen the range to the nearest ticks below and above the data.
  const candidates = logTicks(lo, hi);
  lo = candidates.filter((t) => t <= lo).pop() ?? lo;
  hi = candidates.find((t) => t >= hi) ?? hi;
  const x = scale(x0, x1, m.left, W - m.right);
  const y = scale(Math.log10(lo), Math.log10(hi), H - m.bottom, m.top);

  const root = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'line-chart batch-size-chart',
    role: 'img', 'aria-label': 'Gradient noise scale and effective batch size per update'});
  const axes = svg('g', {class: 'axes'});
  for (const t of candidates.filter((v) => v >= lo && v <= hi)) {
    const ty = y(Math.log10(t));
    axes.append(svg('line', {class: 'grid', x1: m.left, x2: W - m.right, y1: ty, y2: ty}));
    axes.append(text(formatNumber(t), {x: m.left - 6, y: ty + 4, 'text-anchor': 'end'}));
  }
  updateAxis(axes, x, [x0, x1], m, W, H, 'samples or items (log scale)');
  root.append(axes);

  for (const r of runs) {
    const g = svg('g', {class: 'run', 'data-run': r.run});
    const batch = linePath(r.steps, log(r.batch), x, y);
    g.append(svg('path', {class: 'effective-batch', d: batch.d, stroke: r.color,
      'stroke-dasharray': EFFECTIVE_BATCH_DASH, 'data-run': r.run, 'data-points': batch.drawn}));
    const noise = linePath(r.steps, log(r.noise), x, y);
    g.append(svg('path', {class: 'noise-scale', d: noise.d, stroke: r.color, 'data-run': r.run,
      'data-points': noise.drawn}));
    g.append(nonFiniteMarkers('noise-nonfinite', r, r.noise, 'noise scale', x,
      m.top + 7, H - m.bottom - 7));
    root.append(g);
  }
  return withHover(root, runs, x, m, W, H, (r, i) =>
    `${r.run} · update ${r.steps[i]}: B_simple ${formatNumber(r.noise[i])}, ` +
    `effective batch ${formatNumber(r.batch[i])}`);
}

function mix(a, b, t) {
  const pa = [1, 3, 5].map((i) => parseInt(a.slice(i, i + 2), 16));
  const pb = [1, 3, 5].map((i) => parseInt(b.slice(i, i + 2), 16));
  return `rgb(${pa.map((c, i) => Math.round(c + (pb[i] - c) * t)).join(',')})`;
}

/** Colour for t in [0, 1] on a viridis-like ramp. */
function ramp(t) {
  const u = Math.min(1, Math.max(0, t)) * (HEAT_STOPS.length - 1);
  const i = Math.min(HEAT_STOPS.length - 2, Math.floor(u));
  return mix(HEAT_STOPS[i], HEAT_STOPS[i + 1], u - i);
}

let gradientId = 0;

/**
 * Per-variable accumulator norms: rows = variables, columns = update ranges,
 * colour on a log scale, blank where a cell is null. Returns a <div>.
 */
export function heatMap({variables, columns, values}, run) {
  const wrap = document.createElement('div');
  wrap.className = 'heat-map';
  const positive = values.flat().filter((v) => finite(v) && v > 0);
  const [lo, hi] = extent(positive) || [1, 1];
  const logLo = Math.log10(lo);
  const logSpan = Math.log10(hi) - logLo;
  const colour = (v) => {
    if (!finite(v)) return NONFINITE_COLOR;
    if (v <= 0) return ramp(0);
    return ramp(logSpan > 0 ? (Math.log10(v) - logLo) / logSpan : 0.5);
  };

  const W = 900;
  const cellH = 18;
  const longest = variables.reduce((n, v) => Math.max(n, v.length), 0);
  const left = Math.min(260, Math.max(80, longest * 6.8 + 12));
  const top = 6;
  const cellW = (W - left - 12) / Math.max(1, columns.length);
  const gridH = variables.length * cellH;
  const H = top + gridH + 36;
  const root = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'heat', 'data-run': run,
    'data-rows': variables.length, 'data-columns': columns.length, role: 'img',
    'aria-label': 'Accumulator norm per variable and update range'});
  const maxChars = Math.floor((left - 12) / 6.8);
  variables.forEach((name, row) => {
    const label = name.length > maxChars ? `…${name.slice(name.length - maxChars + 1)}` : name;
    const t = text(label, {class: 'row-label', x: left - 8, y: top + row * cellH + cellH / 2 + 4,
      'text-anchor': 'end'});
    const full = svg('title');
    full.textContent = name;
    t.append(full);
    root.append(t);
    (values[row] || []).forEach((v, col) => {
      if (v === null || v === undefined) return; // blank: no update in that range
      const [a, b] = columns[col];
      root.append(svg('rect', {class: 'cell', x: left + col * cellW, y: top + row * cellH,
        width: cellW + 0.3, height: cellH - 1, fill: colour(v)},
      `${name}\nupdates ${a}–${b}: ${formatNumber(v)}`));
    });
  });
  root.append(svg('rect', {class: 'frame', x: left, y: top, width: W - left - 12, height: gridH}));
  // Every k-th column is labelled, under its centre, with the updates it covers.
  const every = Math.max(1, Math.ceil(columns.length / 8));
  columns.forEach(([a, b], col) => {
    if (col % every) return;
    root.append(text(a === b ? String(a) : `${a}–${b}`,
      {x: left + (col + 0.5) * cellW, y: top + gridH + 16, 'text-anchor': 'middle'}));
  });
  root.append(text('optimizer update', {class: 'axis-label', x: left + (W - left) / 2,
    y: top + gridH + 30, 'text-anchor': 'middle'}));
  wrap.append(root, colourLegend(lo, hi, positive.length > 0));
  return wrap;
}

/** A horizontal colour bar with log-scale tick labels. */
function colourLegend(lo, hi, any) {
  const W = 380;
  const H = 42;
  const id = `heat-gradient-${++gradientId}`;
  const root = svg('svg', {viewBox: `0 0 ${W} ${H}`, class: 'heat-legend', width: W, height: H});
  const grad = svg('linearGradient', {id});
  for (let i = 0; i <= 10; i += 1) {
    grad.append(svg('stop', {offset: `${i * 10}%`, 'stop-color': ramp(i / 10)}));
  }
  const defs = svg('defs');
  defs.append(grad);
  root.append(defs);
  const x0 = 30;
  const x1 = 270;
  root.append(svg('rect', {x: x0, y: 4, width: x1 - x0, height: 12, fill: `url(#${id})`}));
  root.append(svg('rect', {x: x1 + 22, y: 4, width: 12, height: 12, fill: NONFINITE_COLOR}));
  root.append(text('non-finite', {x: x1 + 38, y: 14}));
  if (!any) {
    root.append(text('no positive values', {x: x0, y: 32}));
    return root;
  }
  const a = Math.log10(lo);
  const b = Math.log10(hi);
  const pos = (v) => (b > a ? x0 + ((Math.log10(v) - a) / (b - a)) * (x1 - x0) : (x0 + x1) / 2);
  const powers = [];
  for (let p = Math.ceil(a); p <= Math.floor(b); p += Math.max(1, Math.ceil((b - a) / 4))) {
    powers.push(10 ** p);
  }
  const far = (v) => pos(v) - pos(lo) >= 40 && pos(hi) - pos(v) >= 40;
  const labels = hi > lo ? [lo, ...powers.filter(far), hi] : [lo];
  for (const v of labels) {
    const px = pos(v);
    root.append(svg('line', {class: 'tick', x1: px, x2: px, y1: 16, y2: 20}));
    root.append(text(formatNumber(v), {x: px, y: 32, 'text-anchor': 'middle'}));
  }
  return root;
}
