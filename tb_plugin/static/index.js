// Entry point: TensorBoard imports this module in the tab's iframe and calls render().

import {batchSizeChart, heatMap, lineChart} from './charts.js';
import * as model from './model.js';
import * as views from './views.js';

const PALETTE = ['#1a73e8', '#e8710a', '#12b5cb', '#9334e6', '#7cb342', '#795548',
  '#e52592', '#5f6368', '#f9ab00', '#00897b'];

export async function render() {
  const state = {
    runs: [], // [{run, updates, variables, problems}] from /runs
    vocabulary: null, // leftover policies and advisor band, from /runs
    seen: new Set(), // runs listed before: a reload selects only new ones
    selected: new Set(),
    heatRun: null,
    showMicro: true,
    generation: 0, // bumped by every load; replies of older loads are ignored
    data: [], // fetchRun results of the selected runs, in run order
    failed: [], // [{run, reasons}]: selected runs whose data could not be fetched
  };
  const ui = views.mount(() => {
    model.clearCache();
    loadRuns();
  });
  const colorOf = (run) => {
    const i = state.runs.findIndex((r) => r.run === run);
    return PALETTE[(i < 0 ? 0 : i) % PALETTE.length];
  };
  const markReady = () => {
    ui.root.dataset.ready = 'true';
    document.body.dataset.ready = 'true';
  };

  async function loadRuns() {
    const generation = ++state.generation;
    views.setStatus(ui, 'Loading runs…');
    let runs;
    try {
      ({runs, vocabulary: state.vocabulary} = await model.fetchRuns());
    } catch (err) {
      if (generation === state.generation) {
        views.setStatus(ui, `Could not load the runs: ${err.message}`, true);
        ui.content.replaceChildren();
        markReady();
      }
      return;
    }
    if (generation !== state.generation) return;
    state.runs = runs;
    for (const {run} of runs) {
      if (!state.seen.has(run)) state.selected.add(run);
      state.seen.add(run);
    }
    if (!runs.length) {
      views.setStatus(ui, '');
      ui.controls.replaceChildren();
      ui.content.replaceChildren(views.emptyState());
      markReady();
      return;
    }
    ui.controls.replaceChildren(views.runSelector(runs, state.selected, colorOf, (run, on) => {
      if (on) state.selected.add(run); else state.selected.delete(run);
      loadSelected();
    }));
    await loadSelected();
  }

  async function loadSelected() {
    const generation = ++state.generation;
    const runs = state.runs.map((r) => r.run).filter((run) => state.selected.has(run));
    if (!runs.length) {
      views.setStatus(ui, 'Select at least one run.');
      ui.content.replaceChildren();
      markReady();
      return;
    }
    views.setStatus(ui, 'Loading…');
    ui.root.dataset.loading = 'true';
    // One run that cannot be read is reported; it never blanks the others.
    const settled = await Promise.allSettled(runs.map(model.fetchRun));
    if (generation !== state.generation) return; // the selection changed meanwhile
    const data = settled.filter((s) => s.status === 'fulfilled').map((s) => s.value);
    state.failed = settled
      .map((s, i) => ({run: runs[i], reason: s.reason}))
      .filter(({reason}) => reason !== undefined)
      .map(({run, reason}) => ({run, reasons: [`Could not load this run: ${reason.message}`]}));
    if (!data.length) {
      const messages = state.failed.map(({run, reasons}) => `${run}: ${reasons[0]}`);
      views.setStatus(ui, `Could not load the data. ${messages.join('; ')}`, true);
      ui.content.replaceChildren();
      delete ui.root.dataset.loading;
      markReady();
      return;
    }
    state.data = data;
    if (!data.some((d) => d.run === state.heatRun)) state.heatRun = data[0].run;
    views.setStatus(ui, '');
    draw();
    delete ui.root.dataset.loading;
    markReady();
  }

  const sections = {norms: null, heat: null};

  function drawNorms() {
    const lines = state.data.map((d) => ({...d, color: colorOf(d.run)}));
    const notes = state.data
      .filter((d) => d.steps.length < d.sampled)
      .map((d) => `${d.run}: ${d.steps.length} of ${d.sampled} points drawn (extremes kept)`);
    const section = views.normsSection(lineChart(lines, {showMicro: state.showMicro}), {
      showMicro: state.showMicro,
      vocabulary: state.vocabulary,
      onToggleMicro: (on) => {
        state.showMicro = on;
        drawNorms();
      },
      notes,
    });
    sections.norms.replaceWith(section);
    sections.norms = section;
  }

  function drawHeat() {
    const d = state.data.find((x) => x.run === state.heatRun) || state.data[0];
    const section = views.heatSection(state.data.map((x) => x.run), d.run, (run) => {
      state.heatRun = run;
      drawHeat();
    }, heatMap(d.heat, d.run), !d.heat.variables.length);
    sections.heat.replaceWith(section);
    sections.heat = section;
  }

  function lossCard() {
    const lines = state.data
      .filter((d) => d.loss.some((v) => v !== null))
      .map((d) => ({...d, color: colorOf(d.run)}));
    if (!lines.length) return document.createComment('no window loss recorded');
    return views.lossSection(lineChart(lines, {value: 'loss', axis: 'window loss',
      title: 'Window loss per optimizer update'}));
  }

  function advisor() {
    const lines = state.data.map((d) => ({...d, color: colorOf(d.run)}));
    const rows = lines.map((d) => ({run: d.run, color: d.color, advice: d.advice}));
    const nonFinite = state.data.some(
      (d) => d.noise.some((v) => v !== null && !Number.isFinite(v)));
    return views.advisorSection(batchSizeChart(lines), rows, {nonFinite});
  }

  function draw() {
    sections.norms = document.createElement('section');
    sections.heat = document.createElement('section');
    const counters = views.countersTable(
      state.data.map((d) => ({run: d.run, color: colorOf(d.run), counters: d.counters})));
    const problems = [...state.data.map((d) => ({run: d.run, reasons: d.problems})),
      ...state.failed]
      .filter((p) => p.reasons.length)
      .map((p) => ({...p, color: colorOf(p.run)}));
    const shown = problems.length ? [views.problemsSection(problems)] : [];
    ui.content.replaceChildren(...shown, sections.norms, lossCard(), advisor(), sections.heat,
      counters);
    drawNorms();
    drawHeat();
  }

  await loadRuns();
}
