// Training charts: line charts on <canvas> for the job page (loss, eval metric, LR,
// throughput) and the compare page (several jobs, one metric). Data comes from
// /jobs/{id}/series, already downsampled by the server (min/max per bucket), so a
// 100k-step run draws as ~1000 points. Smoothing is an exponential moving average,
// like TensorBoard's; log scale plots log10 of the values. Until the log control is
// touched (it starts indeterminate, "auto"), each chart picks log scale itself when its
// values span two orders of magnitude or more: one divergent AutoLRS candidate would
// otherwise flatten the rest of the loss curve.
(function () {
  "use strict";
  var COLOURS = ["#4338ca", "#d92d20", "#067647", "#b54708", "#0e7090", "#c11574", "#475467", "#6941c6"];

  async function fetchSeries(id, maxPoints) {
    var response = await fetch("/jobs/" + id + "/series?max_points=" + maxPoints, { headers: { "x-requested-with": "train.js" } });
    if (!response.ok) throw new Error("series of " + id + ": HTTP " + response.status);
    return response.json();
  }

  // [[step, value], …] of one metric from the rows of `series` ("steps" or "evals").
  function pick(data, series, name) {
    var out = [];
    (data[series] || []).forEach(function (row) {
      if (typeof row[name] === "number") out.push([row.step, row[name]]);
    });
    return out;
  }

  function smooth(points, weight) {
    if (!weight) return points;
    var last = null;
    return points.map(function (p) {
      last = last === null ? p[1] : last * weight + p[1] * (1 - weight);
      return [p[0], last];
    });
  }

  // Ticks at a round step; counted by index, so a step too small to move `t` cannot loop.
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) { hi = lo + 1; }
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / count)));
    var err = (hi - lo) / count / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var first = Math.ceil(lo / step) * step, ticks = [];
    for (var i = 0; i <= 4 * count && first + i * step <= hi + step * 1e-9; i++) ticks.push(first + i * step);
    return ticks;
  }

  // [min, max] of a list, by loop: spreading a long list into Math.min overflows the stack.
  function extent(values) {
    var lo = Infinity, hi = -Infinity;
    for (var i = 0; i < values.length; i++) { lo = Math.min(lo, values[i]); hi = Math.max(hi, values[i]); }
    return [lo, hi];
  }

  function label(v) {
    var a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(1);
    return String(+v.toPrecision(4));
  }

  // Whether the lines' positive values span at least two orders of magnitude.
  function spansDecades(lines) {
    var lo = Infinity, hi = 0;
    lines.forEach(function (l) { l.points.forEach(function (p) { if (p[1] > 0 && isFinite(p[1])) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); } }); });
    return hi > 0 && hi / lo >= 100;
  }

  // The log control as "auto" until the user sets it; `useLog` then decides per chart.
  function autoLog(control) {
    if (!control) return;
    control.indeterminate = true;
    control.addEventListener("input", function () { control.setAttribute("data-touched", ""); }, { once: true });
  }

  function useLog(control, lines) {
    if (control && control.hasAttribute("data-touched")) return control.checked;
    return spansDecades(lines);
  }

  // lines: [{name, points: [[x, y], …], colour}]; opts: {log}
  function draw(canvas, lines, opts) {
    var ratio = window.devicePixelRatio || 1;
    var width = canvas.clientWidth, height = canvas.clientHeight || +canvas.getAttribute("height");
    canvas.width = width * ratio; canvas.height = height * ratio;
    var ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    var tf = opts.log ? function (v) { return v > 0 ? Math.log10(v) : NaN; } : function (v) { return v; };
    var xs = [], ys = [];
    lines.forEach(function (l) { l.points.forEach(function (p) { var y = tf(p[1]); if (isFinite(y)) { xs.push(p[0]); ys.push(y); } }); });
    ctx.fillStyle = getComputedStyle(canvas).color;
    ctx.font = "11px system-ui, sans-serif";
    if (!xs.length) { ctx.fillText("No points yet", 12, 20); return; }
    var xr = extent(xs), yr = extent(ys), x0 = xr[0], x1 = xr[1], y0 = yr[0], y1 = yr[1];
    // A flat line (smoothing leaves one a few ULPs wide) gets a unit-wide axis around it.
    if (y1 - y0 <= Math.abs(y1) * 1e-9) { y0 -= 0.5; y1 += 0.5; }
    if (x1 === x0) { x1 = x0 + 1; }
    var left = 52, right = 10, top = 8, bottom = 22;
    var sx = function (x) { return left + (x - x0) / (x1 - x0) * (width - left - right); };
    var sy = function (y) { return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom); };
    ctx.strokeStyle = "rgba(128,128,128,.25)"; ctx.lineWidth = 1;
    niceTicks(y0, y1, 5).forEach(function (t) {
      ctx.beginPath(); ctx.moveTo(left, sy(t)); ctx.lineTo(width - right, sy(t)); ctx.stroke();
      ctx.fillText(label(opts.log ? Math.pow(10, t) : t), 4, sy(t) + 4);
    });
    niceTicks(x0, x1, 6).forEach(function (t) { ctx.fillText(label(t), sx(t) - 10, height - 6); });
    lines.forEach(function (l) {
      ctx.strokeStyle = l.colour; ctx.lineWidth = 1.5; ctx.beginPath();
      var open = false;
      l.points.forEach(function (p) {
        var y = tf(p[1]);
        if (!isFinite(y)) { open = false; return; }
        if (open) ctx.lineTo(sx(p[0]), sy(y)); else ctx.moveTo(sx(p[0]), sy(y));
        open = true;
      });
      ctx.stroke();
      if (l.points.length < 40) {
        ctx.fillStyle = l.colour;
        l.points.forEach(function (p) { var y = tf(p[1]); if (isFinite(y)) ctx.fillRect(sx(p[0]) - 2, sy(y) - 2, 4, 4); });
      }
    });
  }

  function legend(box, lines) {
    if (!box) return;
    box.textContent = "";
    lines.forEach(function (l) {
      var item = document.createElement("span");
      item.className = "legend-item";
      var swatch = document.createElement("i");
      swatch.style.background = l.colour;
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(l.name + " (" + l.points.length + " pts)"));
      box.appendChild(item);
    });
  }

  // The job page: one chart per [data-chart] ("steps:loss", "evals:*" for every eval
  // metric), refreshed every 5 s while the job runs.
  function jobCharts(root) {
    var id = root.getAttribute("data-train-charts");
    var charts = Array.prototype.slice.call(root.querySelectorAll("[data-chart]"));
    var smoothing = root.querySelector("[data-control=smoothing]");
    var log = root.querySelector("[data-control=log]");
    var data = null;
    function render() {
      charts.forEach(function (chart) {
        var spec = chart.getAttribute("data-chart").split(":");
        var names = spec[1] === "*" ? evalNames(data) : [spec[1]];
        var weight = spec[0] === "steps" && smoothing ? +smoothing.value : 0;
        var lines = names.map(function (name, i) {
          return { name: name, points: smooth(pick(data, spec[0], name), weight), colour: COLOURS[i % COLOURS.length] };
        });
        var logScale = spec[1] !== "throughput" && useLog(log, lines);
        chart.setAttribute("data-log", String(logScale));
        draw(chart.querySelector("canvas"), lines, { log: logScale });
        legend(chart.querySelector(".chart-legend"), lines);
      });
    }
    function evalNames(d) {
      var names = {};
      (d.evals || []).forEach(function (row) { Object.keys(row).forEach(function (k) { if (typeof row[k] === "number" && k !== "step") names[k] = true; }); });
      return Object.keys(names).sort();
    }
    async function refresh() {
      try {
        data = await fetchSeries(id, 1000);
        render();
      } catch (e) { root.setAttribute("data-error", e.message); }
      if (root.hasAttribute("data-live-charts") && !document.querySelector("[data-live-final]")) setTimeout(refresh, 5000);
    }
    autoLog(log);
    [smoothing, log].forEach(function (c) { if (c) c.addEventListener("input", function () { syncOutput(c); if (data) render(); }); });
    window.addEventListener("resize", function () { if (data) render(); });
    refresh();
  }

  function syncOutput(control) {
    var out = control.parentNode.querySelector("output");
    if (out) out.textContent = control.value;
  }

  // The compare page: every selected job's curve of one metric on one chart.
  function compareChart(root) {
    var ids = root.getAttribute("data-compare").split(",").filter(Boolean);
    var names = {};
    document.querySelectorAll("[data-compare-job]").forEach(function (box) { names[box.value] = box.getAttribute("data-compare-job"); });
    var metric = root.querySelector("[data-control=metric]");
    var smoothing = root.querySelector("[data-control=smoothing]");
    var log = root.querySelector("[data-control=log]");
    var loaded = {};
    function render() {
      var spec = metric.value.split(":");
      var lines = ids.filter(function (id) { return loaded[id]; }).map(function (id, i) {
        return { name: names[id] || id.slice(0, 8), points: smooth(pick(loaded[id], spec[0], spec[1]), +smoothing.value), colour: COLOURS[i % COLOURS.length] };
      });
      var logScale = useLog(log, lines);
      root.setAttribute("data-log", String(logScale));
      draw(root.querySelector("canvas"), lines, { log: logScale });
      legend(root.querySelector(".chart-legend"), lines);
    }
    autoLog(log);
    [metric, smoothing, log].forEach(function (c) { c.addEventListener("input", function () { syncOutput(c); render(); }); });
    window.addEventListener("resize", render);
    ids.forEach(function (id) {
      fetchSeries(id, 1500).then(function (d) { loaded[id] = d; render(); }, function (e) { root.setAttribute("data-error", e.message); });
    });
    render();
    var form = document.getElementById("compare-form");
    if (form) form.addEventListener("submit", function () {
      var chosen = [];
      form.querySelectorAll("[data-compare-job]").forEach(function (box) { if (box.checked) chosen.push(box.value); });
      document.getElementById("compare-ids").value = chosen.join(",");
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-train-charts]").forEach(jobCharts);
    document.querySelectorAll("[data-compare]").forEach(compareChart);
  });
})();
