// Charts drawn as SVG: a line chart of several series over the last minutes, and a sparkline.
// Lines only; labels and legends are HTML beside the SVG, so they never stretch with it.

const NS = 'http://www.w3.org/2000/svg';
const W = 600;
const H = 160;

function el(name, attrs) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

/** A number as people read it: 1234 -> "1.2k", 0.0042 -> "0.004". */
export function fmt(v, unit = '') {
  if (v === null || v === undefined || Number.isNaN(v)) return '–';
  const a = Math.abs(v);
  let s;
  if (a >= 1e9) s = (v / 1e9).toFixed(1) + 'G';
  else if (a >= 1e6) s = (v / 1e6).toFixed(1) + 'M';
  else if (a >= 1e4) s = (v / 1e3).toFixed(1) + 'k';
  else if (a >= 100 || Number.isInteger(v)) s = Math.round(v).toString();
  else if (a >= 1) s = v.toFixed(1);
  else s = v.toPrecision(2);
  return s + unit;
}

/** The top of a y axis: a round number at or above `max`. */
function niceMax(max) {
  if (!(max > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(max)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= max) return m * p;
  return 10 * p;
}

/**
 * The runs of `samples` a line may join: a run ends where a value is missing or where more
 * than `maxGapMs` passed between two samples (Shoal was stopped, or the page was asleep), so
 * a chart shows the gap instead of a ramp that never happened. Each run is [{at, v}].
 */
export function runsOf(samples, valueOf, maxGapMs) {
  const runs = [];
  let run = [];
  let lastAt = null;
  for (const s of samples) {
    const v = valueOf(s);
    const gap = lastAt !== null && s.at - lastAt > maxGapMs;
    if (gap || v === null || v === undefined || !Number.isFinite(v)) {
      if (run.length) runs.push(run);
      run = [];
    }
    if (v !== null && v !== undefined && Number.isFinite(v)) run.push({ at: s.at, v });
    lastAt = s.at;
  }
  if (run.length) runs.push(run);
  return runs;
}

/** The usual time between samples (their median spacing), and at least a second. */
function spacing(samples) {
  const d = [];
  for (let i = 1; i < samples.length; i++) d.push(samples[i].at - samples[i - 1].at);
  d.sort((a, b) => a - b);
  return Math.max(1000, d.length ? d[d.length >> 1] : 1000);
}

/**
 * A chart of `series` ({name, key, color}) over samples; `update(samples)` redraws it.
 * It spans the samples kept (at least a minute, at most `windowMs`), ending at the newest.
 */
export function lineChart(container, { title, series, unit = '', windowMs = 15 * 60 * 1000 }) {
  container.classList.add('chart');
  const head = document.createElement('div');
  head.className = 'chart-head';
  const h = document.createElement('h3');
  h.textContent = title;
  const top = document.createElement('span');
  top.className = 'chart-max';
  head.append(h, top);
  const svg = el('svg', { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: 'none', role: 'img' });
  for (const f of [0.25, 0.5, 0.75]) {
    svg.append(el('line', { x1: 0, x2: W, y1: H * f, y2: H * f, class: 'grid', 'vector-effect': 'non-scaling-stroke' }));
  }
  const lines = series.map((s) => {
    const p = el('path', { fill: 'none', class: 'series', stroke: s.color, 'stroke-width': 2, 'vector-effect': 'non-scaling-stroke' });
    svg.append(p);
    return p;
  });
  const legend = document.createElement('ul');
  legend.className = 'legend';
  const values = series.map((s) => {
    const li = document.createElement('li');
    const sw = document.createElement('span');
    sw.className = 'swatch';
    sw.style.background = s.color;
    const v = document.createElement('b');
    li.append(sw, document.createTextNode(s.name + ' '), v);
    legend.append(li);
    return v;
  });
  container.replaceChildren(head, svg, legend);

  return {
    update(samples) {
      // The span shown grows with the history kept, up to `windowMs`.
      const end = samples.length ? samples[samples.length - 1].at : Date.now();
      const start = Math.max(end - windowMs, samples.length ? Math.min(samples[0].at, end - 60000) : end - windowMs);
      const span = end - start;
      let max = 0;
      for (const s of samples) for (const se of series) {
        const v = se.value ? se.value(s) : s[se.key];
        if (v > max && Number.isFinite(v)) max = v;
      }
      const top = niceMax(max);
      const minutes = Math.round(span / 60000);
      head.querySelector('.chart-max').textContent = `last ${minutes} min · max ${fmt(top, unit)}`;
      const spoken = [];
      const shown = samples.filter((s) => s.at >= start);
      const maxGap = 3 * spacing(shown);
      series.forEach((se, i) => {
        const valueOf = (s) => (se.value ? se.value(s) : s[se.key]);
        const d = runsOf(shown, valueOf, maxGap).map((run) => run.map(({ at, v }, j) => {
          const x = ((at - start) / span) * W;
          const y = H - (v / top) * (H - 4) - 2;
          return `${j ? 'L' : 'M'}${x.toFixed(1)},${y.toFixed(1)}`;
        }).join(' ')).join(' ');
        lines[i].setAttribute('d', d);
        const last = samples.length ? samples[samples.length - 1] : null;
        const v = last ? (se.value ? se.value(last) : last[se.key]) : null;
        values[i].textContent = fmt(v, unit);
        spoken.push(`${se.name} ${fmt(v, unit)}`);
      });
      svg.setAttribute('aria-label', `${title}, last ${minutes} minutes; now: ${spoken.join(', ')}`);
    },
  };
}

/** A small line of `values` (oldest first), for table rows. */
export function sparkline(values, label) {
  const w = 120;
  const h = 24;
  const svg = el('svg', { viewBox: `0 0 ${w} ${h}`, class: 'spark', role: 'img', 'aria-label': label, preserveAspectRatio: 'none' });
  const top = niceMax(Math.max(0, ...values));
  const step = values.length > 1 ? w / (values.length - 1) : w;
  const pts = values.map((v, i) => `${(i * step).toFixed(1)},${(h - (v / top) * (h - 2) - 1).toFixed(1)}`);
  svg.append(el('polyline', { points: pts.join(' '), fill: 'none', class: 'spark-line', 'stroke-width': 1.5, 'vector-effect': 'non-scaling-stroke' }));
  return svg;
}
