// gradmon's live page: polls api/history every REFRESH_MS and draws what it kept.
// No library, no inline script (the page is served with default-src 'self'); every name
// from the training process is written with textContent, never as markup.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const MAX_COLUMNS = 500;
  const ROW_PX = 13;
  const $ = (id) => document.getElementById(id);

  let state = fresh(null);
  let limited = 0;  // answers in a row that were the endpoint's rate limit (429)

  function fresh(model) {
    return {
      model: model, since: null, capacity: 2000, steps: [], norm: [], loss: [], bad: [], skipped: [],
      heat: { every: 0, rows: [], steps: [], cols: [] }, prev: null, rate: null, doc: null,
    };
  }

  function text(el, value) { el.textContent = value; }

  function fmt(x) {
    if (x === null || x === undefined) return "–";
    if (x === 0) return "0";
    const a = Math.abs(x);
    return a >= 1e-3 && a < 1e5 ? Number(x.toPrecision(4)).toString() : x.toExponential(2);
  }

  async function refresh() {
    const query = new URLSearchParams();
    if (state.model !== null) query.set("model", state.model);
    if (state.since !== null) query.set("since", String(state.since));
    const full = state.since === null;  // the whole window: it replaces what the page holds
    let wait = REFRESH_MS;
    try {
      const response = await fetch("api/history?" + query.toString(), { cache: "no-store", credentials: "same-origin" });
      if (response.status === 429) {
        // the rate limit (quick reloads, several tabs): no failure, ask again when it says
        wait = Math.max(1000, 1000 * (Number(response.headers.get("Retry-After")) || 1));
        if (++limited >= 3) text($("status"), "the endpoint limits requests (several pages open?); waiting");
      } else {
        if (!response.ok) throw new Error("HTTP " + response.status);
        apply(await response.json(), full);
        if (!full && state.since === null) wait = 0;  // it asked for the whole window: at once
        limited = 0;
        $("status").classList.remove("bad");
      }
    } catch (err) {
      text($("status"), "cannot read the endpoint (" + err.message + "); retrying");
      $("status").classList.add("bad");
    }
    window.setTimeout(refresh, wait);
  }

  function apply(doc, full) {
    if (state.model !== null && doc.model !== state.model) state = fresh(doc.model);
    if (state.model === null) state.model = doc.model;
    picker(doc.models || []);
    if (state.prev && doc.steps_total > state.prev.steps_total) {
      state.rate = (doc.steps_total - state.prev.steps_total) / (doc.time - state.prev.time);
    }
    state.prev = { steps_total: doc.steps_total, time: doc.time };
    state.doc = doc;
    const h = doc.history;
    if (h) merge(h, full);
    facts(doc);
    tables(doc);
    draw(h !== null && h !== undefined);
    document.body.dataset.step = String(doc.step);
    document.body.dataset.kept = String(state.steps.length);
  }

  const SERIES = ["steps", "norm", "loss", "bad", "skipped"];

  function merge(h, full) {
    const hm = h.heatmap;
    if (!full && (hm.every !== state.heat.every || hm.rows.length !== state.heat.rows.length)) {
      // the columns are spaced anew as the window fills: ask for the whole window again
      state.since = null;
      return;
    }
    if (full) {
      for (const key of SERIES) state[key] = [];
      state.heat = { every: hm.every, rows: hm.rows, steps: [], cols: [] };
      rows(hm.rows);
    }
    state.capacity = h.capacity;
    for (let i = 0; i < h.steps.length; i++) {
      state.steps.push(h.steps[i]);
      state.norm.push(h.global_norm[i]);
      state.loss.push(h.loss[i]);
      state.bad.push(h.nonfinite[i] === 1);
      state.skipped.push(h.skipped[i] === 1);
    }
    const drop = state.steps.length - state.capacity;
    if (drop > 0) for (const key of SERIES) state[key].splice(0, drop);
    for (let i = 0; i < hm.steps.length; i++) {
      state.heat.steps.push(hm.steps[i]);
      state.heat.cols.push(hm.log10[i]);
    }
    const over = state.heat.steps.length - MAX_COLUMNS;
    if (over > 0) { state.heat.steps.splice(0, over); state.heat.cols.splice(0, over); }
    if (state.steps.length) state.since = state.steps[state.steps.length - 1];
  }

  function picker(models) {
    const select = $("model");
    $("picker").hidden = models.length < 2;
    const names = models.map((m) => m.model);
    if (select.options.length !== names.length || names.some((n, i) => select.options[i].value !== n)) {
      select.replaceChildren(...names.map((n) => { const o = document.createElement("option"); o.value = n; o.textContent = n; return o; }));
    }
    select.value = state.model;
  }

  function rows(names) {
    const list = $("rows");
    list.replaceChildren(...names.map((n) => { const li = document.createElement("li"); li.textContent = n; return li; }));
    $("heatmap").dataset.rows = String(names.length);
    $("heatmap").style.height = (names.length * ROW_PX) + "px";  // one list line per row
  }

  // an element holding text (never markup), in red when bad
  function el(tag, content, bad) {
    const node = document.createElement(tag);
    node.textContent = content;
    if (bad) node.className = "bad";
    return node;
  }

  function fact(label, value, bad) {
    const span = document.createElement("span");
    span.append(label + " ", el("b", value, bad));
    return span;
  }

  function facts(doc) {
    const lr = (doc.learning_rates || []).map(fmt).join(", ");
    const items = [
      fact("model", doc.model), fact("rank", doc.rank + " of " + (doc.world_size || "1")),
      fact("state", doc.state + (doc.failure ? " (" + doc.failure + ")" : ""), doc.state === "failed"),
      fact("step", doc.step === null ? "–" : String(doc.step)), fact("steps/s", state.rate === null ? "–" : fmt(state.rate)),
      fact("global norm", fmt(doc.global_norm)), fact("loss", fmt(doc.loss)), fact("learning rate", lr || "–"),
      fact("steps with NaN/Inf", String(doc.nonfinite_steps), doc.nonfinite_steps > 0),
    ];
    if (doc.guard) items.push(guard(doc.guard));
    $("facts").replaceChildren(...items);
    text($("status"), "read at " + new Date(doc.time * 1000).toLocaleTimeString());
  }

  // the step guard's skips: each reason's count, and where the latest one was
  function guard(g) {
    const counts = Object.entries(g.skipped);
    const total = counts.reduce((sum, [, n]) => sum + n, 0);
    const latest = g.last_step === null ? "" : ", latest at step " + g.last_step + ": " + g.last_reason;
    const value = total + " (" + counts.map(([reason, n]) => reason + " " + n).join(", ") + ")" + latest;
    const span = fact("steps skipped by the guard", value, total > 0);
    span.id = "guard";
    return span;
  }

  function row(cells, bad) {
    const tr = document.createElement("tr");
    tr.append(...cells.map((c) => el("td", c, bad)));
    return tr;
  }

  function tables(doc) {
    const nf = [row(["tensor", "elements"])];
    for (const [tensor, n] of Object.entries(doc.nonfinite || {})) nf.push(row([tensor, String(n)], n > 0));
    for (const o of doc.origin || []) {
      nf.push(row(["started in (" + o.tensor + ")", o.layer + " at step " + o.step], true));
    }
    $("nonfinite").replaceChildren(...nf);
    const acts = [row(["layer", "max |x|", "fp16 headroom"])];
    for (const a of doc.activations || []) {
      const headroom = a.fp16_range_used ? "x" + fmt(1 / a.fp16_range_used) : (a.abs_max ? "not fp16" : "–");
      acts.push(row([a.layer, a.abs_max === null ? "non-finite" : fmt(a.abs_max), headroom],
        a.abs_max === null || (a.fp16_range_used !== null && a.fp16_range_used > 0.5)));
    }
    $("activations").replaceChildren(...acts);
  }

  function draw(kept) {
    text($("heatnote"), kept ? "" : "This rank keeps no per-layer history (a data-parallel rank other than 0): its own numbers are above.");
    line($("norm"), state.norm, true);
    line($("loss"), state.loss, false);
    heatmap($("heatmap"));
  }

  function line(canvas, values, log) {
    const ctx = canvas.getContext("2d");
    const w = canvas.width, h = canvas.height, pad = 34;
    ctx.clearRect(0, 0, w, h);
    const ys = values.map((v) => (v === null || v === undefined || (log && v <= 0)) ? null : (log ? Math.log10(v) : v));
    const good = ys.filter((v) => v !== null);
    ctx.fillStyle = "#c62828";
    const n = Math.max(values.length, 2);
    const x = (i) => pad + (w - pad - 4) * i / (n - 1);
    if (values === state.norm) {
      state.bad.forEach((bad, i) => { if (bad) ctx.fillRect(x(i) - 1, 0, 2, h); });
      ctx.fillStyle = "#ef8f00";
      state.skipped.forEach((skipped, i) => { if (skipped) ctx.fillRect(x(i) - 1, 0, 2, h); });
    }
    if (!good.length) return;
    let lo = Math.min(...good), hi = Math.max(...good);
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const y = (v) => h - 14 - (h - 24) * (v - lo) / (hi - lo);
    ctx.strokeStyle = "#1565c0";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    let open = false;
    ys.forEach((v, i) => {
      if (v === null) { open = false; return; }
      if (open) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
      open = true;
    });
    ctx.stroke();
    ctx.fillStyle = "#667";
    ctx.font = "11px sans-serif";
    const label = (v) => fmt(log ? Math.pow(10, v) : v);
    ctx.fillText(label(hi), 2, 12);
    ctx.fillText(label(lo), 2, h - 16);
    if (state.steps.length) {
      ctx.fillText("step " + state.steps[0], pad, h - 2);
      const last = "step " + state.steps[state.steps.length - 1];
      ctx.fillText(last, w - 4 - ctx.measureText(last).width, h - 2);
    }
  }

  // a perceptual ramp (turbo-like), low to high
  const RAMP = [[48, 18, 59], [70, 134, 251], [26, 228, 182], [162, 252, 60], [250, 187, 57], [228, 70, 10], [122, 4, 3]];
  function color(t) {
    const p = Math.max(0, Math.min(1, t)) * (RAMP.length - 1);
    const i = Math.min(RAMP.length - 2, Math.floor(p)), f = p - i;
    const c = RAMP[i].map((a, k) => Math.round(a + (RAMP[i + 1][k] - a) * f));
    return "rgb(" + c.join(",") + ")";
  }

  // a cell's colour when it has no number: its legend swatch's, so the two cannot differ
  const swatch = (id) => window.getComputedStyle($(id)).backgroundColor;

  function heatmap(canvas) {
    const ctx = canvas.getContext("2d");
    const cols = state.heat.cols, nrows = state.heat.rows.length;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    canvas.dataset.columns = String(cols.length);
    if (!cols.length || !nrows) return;
    const none = swatch("novalue"), nonfinite = swatch("nonfinitecell");
    let lo = Infinity, hi = -Infinity;
    for (const col of cols) for (const v of col) if (typeof v === "number") { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (lo === Infinity) { lo = 0; hi = 1; }
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const cw = canvas.width / cols.length, rh = canvas.height / nrows;
    cols.forEach((col, j) => col.forEach((v, r) => {
      ctx.fillStyle = typeof v === "number" ? color((v - lo) / (hi - lo)) : v === "nonfinite" ? nonfinite : none;
      ctx.fillRect(j * cw, r * rh, Math.ceil(cw), Math.ceil(rh));
    }));
    text($("heatlow"), fmt(Math.pow(10, lo)));
    text($("heathigh"), fmt(Math.pow(10, hi)));
  }

  $("model").addEventListener("change", (event) => { state = fresh(event.target.value); });
  refresh();
})();
