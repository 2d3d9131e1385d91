// The server's live state from its Prometheus /metrics text: gauges as they are, and latency
// percentiles over a recent window from the difference of two scrapes of a histogram (what
// Prometheus's histogram_quantile over a rate() computes).

const SAMPLE = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /(\w+)="((?:[^"\\]|\\.)*)"/g;

export const RUNNING = "servelm_num_requests_running";
export const WAITING = "servelm_num_requests_waiting";
export const KV_USAGE = "servelm_kv_cache_usage_perc";
export const TTFT = "servelm_time_to_first_token_seconds";
export const TPOT = "servelm_time_per_output_token_seconds";

// name -> list of {labels, value}
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = SAMPLE.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[2] || "").matchAll(LABEL)) labels[k] = v;
    if (!samples.has(m[1])) samples.set(m[1], []);
    samples.get(m[1]).push({ labels, value: Number(m[3]) });
  }
  return samples;
}

// A gauge summed over its series (one per model name); null when the server does not export it.
export function gauge(samples, name) {
  const series = samples.get(name);
  return series ? series.reduce((sum, s) => sum + s.value, 0) : null;
}

// A histogram's cumulative buckets, summed over series: [[upper bound, count], ...] by bound.
export function buckets(samples, name) {
  const byBound = new Map();
  for (const s of samples.get(`${name}_bucket`) || []) {
    const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
    byBound.set(le, (byBound.get(le) || 0) + s.value);
  }
  return [...byBound].sort((a, b) => a[0] - b[0]);
}

// The q-quantile of the observations between two scrapes of the same histogram, interpolated
// linearly inside its bucket; null when nothing was observed in between.
export function quantile(q, now, before) {
  const then = new Map(before || []);
  const delta = now.map(([le, count]) => [le, count - (then.get(le) || 0)]);
  const total = delta.length ? delta[delta.length - 1][1] : 0;
  if (total <= 0) return null;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const [le, count] of delta) {
    if (count >= rank) {
      if (le === Infinity) return lower;
      return lower + (le - lower) * ((rank - below) / Math.max(count - below, 1e-12));
    }
    lower = le;
    below = count;
  }
  return lower;
}

// Scrapes kept for the chart and the percentile window.
export class ServerHistory {
  constructor(keepSeconds = 300, windowSeconds = 60) {
    this.keepMs = keepSeconds * 1000;
    this.windowMs = windowSeconds * 1000;
    this.points = [];
  }

  add(samples, t = Date.now()) {
    this.points.push({
      t,
      running: gauge(samples, RUNNING),
      waiting: gauge(samples, WAITING),
      kv: gauge(samples, KV_USAGE),
      ttft: buckets(samples, TTFT),
      tpot: buckets(samples, TPOT),
    });
    while (this.points.length > 1 && this.points[0].t < t - this.keepMs) this.points.shift();
  }

  latest() {
    return this.points[this.points.length - 1];
  }

  // p50/p90/p99 of a histogram ("ttft" or "tpot") over the window; the first scrape counts from zero.
  percentiles(key) {
    const last = this.latest();
    if (!last) return null;
    const start = this.points.find((p) => p.t >= last.t - this.windowMs);
    const base = start === last ? (this.points.length > 1 ? this.points[this.points.length - 2] : null) : start;
    const before = base ? base[key] : [];
    return [0.5, 0.9, 0.99].map((q) => quantile(q, last[key], before));
  }
}
