// Running and waiting requests over the kept scrapes, as two lines on a canvas (no library: two
// polylines and a scale do not need one).

function seriesMax(points) {
  let max = 1;
  for (const p of points) max = Math.max(max, p.running || 0, p.waiting || 0);
  return max;
}

export function drawChart(canvas, points, spanMs) {
  const ctx = canvas.getContext("2d");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width;
  const height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(canvas);
  const pad = { left: 24, right: 4, top: 6, bottom: 6 };
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const max = seriesMax(points);
  const now = points.length ? points[points.length - 1].t : Date.now();
  const x = (t) => pad.left + plotW * (1 - (now - t) / spanMs);
  const y = (v) => pad.top + plotH * (1 - v / max);

  ctx.strokeStyle = style.getPropertyValue("--grid").trim() || "#ccc";
  ctx.fillStyle = style.getPropertyValue("--muted").trim() || "#666";
  ctx.font = "10px sans-serif";
  ctx.lineWidth = 1;
  for (const v of [0, max]) {
    ctx.beginPath();
    ctx.moveTo(pad.left, y(v));
    ctx.lineTo(width - pad.right, y(v));
    ctx.stroke();
    ctx.fillText(String(v), 2, y(v) + 3);
  }
  for (const [key, color] of [["waiting", "--waiting"], ["running", "--running"]]) {
    ctx.strokeStyle = style.getPropertyValue(color).trim() || "#000";
    ctx.lineWidth = 2;
    ctx.beginPath();
    let started = false;
    for (const p of points) {
      if (p[key] === null) continue;
      if (started) ctx.lineTo(x(p.t), y(p[key]));
      else ctx.moveTo(x(p.t), y(p[key]));
      started = true;
    }
    ctx.stroke();
  }
}
