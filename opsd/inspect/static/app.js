// opsd inspect: one page, routed by the URL fragment (#/step/3/group/g1/traj/r0). Plain DOM, no library.
// Every text from the run goes in through textContent (el()), never as HTML: dumps hold model output.
"use strict";

const view = document.getElementById("view");
const crumbs = document.getElementById("crumbs");
const enc = encodeURIComponent;

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") e.textContent = v; else if (k === "on") for (const [ev, f] of Object.entries(v)) e.addEventListener(ev, f);
    else e.setAttribute(k, v);
  }
  for (const c of kids.flat()) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}
// replaceChildren() with lists flattened and null/undefined (absent parts) left out.
function fill(parent, ...kids) {
  parent.replaceChildren(...kids.flat(2).filter(k => k !== null && k !== undefined));
}
const fmt = (x, d = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));

async function api(path, params) {
  const q = new URLSearchParams(params || {}).toString();
  const r = await fetch(`/api/${path}${q ? "?" + q : ""}`, { credentials: "same-origin" });
  let body = null;
  try { body = await r.json(); } catch (_) { body = { detail: r.statusText }; }
  if (!r.ok) throw new Error(`${r.status}: ${body.detail || r.statusText}`);
  return body;
}

function setCrumbs(parts) {  // parts: [[label, hash], ...]
  crumbs.replaceChildren(...parts.map(([label, h]) => el("a", { href: h, text: "/ " + label })));
}

// ------------------------------------------------------------------ plots: inline SVG, drawn here
function plot(title, points, w = 300, h = 150) {
  const pad = { l: 44, r: 8, t: 8, b: 20 };
  const xs = points.map(p => p[0]), ys = points.map(p => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  // One step, or a flat curve: widen towards 0 so a rate never shows a negative axis (steps start at 0).
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) [y0, y1] = y0 === 0 ? [0, 1] : [Math.min(0, y0), Math.max(0, y0)];
  const X = x => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  const ns = "http://www.w3.org/2000/svg";
  const s = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const svg = s("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}`, "data-metric": title });
  svg.append(s("line", { x1: pad.l, y1: h - pad.b, x2: w - pad.r, y2: h - pad.b, stroke: "#999" }));
  svg.append(s("line", { x1: pad.l, y1: pad.t, x2: pad.l, y2: h - pad.b, stroke: "#999" }));
  svg.append(s("text", { x: pad.l - 4, y: pad.t + 8, "text-anchor": "end" }, fmt(y1, 3)));
  svg.append(s("text", { x: pad.l - 4, y: h - pad.b, "text-anchor": "end" }, fmt(y0, 3)));
  svg.append(s("text", { x: pad.l, y: h - 6 }, `step ${x0}`));
  svg.append(s("text", { x: w - pad.r, y: h - 6, "text-anchor": "end" }, `${x1}`));
  svg.append(s("polyline", { points: points.map(p => `${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: "#1e88e5", "stroke-width": 1.5 }));
  for (const p of points) {
    const c = s("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: "#1e88e5" });
    c.append(s("title", {}, `step ${p[0]}: ${p[1]}`));
    svg.append(c);
  }
  return el("div", { class: "plot" }, el("div", { class: "title", text: title }), svg);
}

// Advantage -> background colour: green above 0, red below, opacity by |a| / scale.
function advColor(a, scale) {
  const t = Math.min(1, Math.abs(a) / (scale || 1));
  return a >= 0 ? `rgba(46,160,67,${0.08 + 0.72 * t})` : `rgba(218,54,51,${0.08 + 0.72 * t})`;
}

// ------------------------------------------------------------------ pages
// metrics.jsonl keys the trainer writes (services/trainer/__main__.py _step_record, report.py summarize), plotted first.
const PREFERRED = ["success_rate", "reward_mean", "teacher_student_gap", "privileged_signal", "mean_span_length", "loss"];

async function runPage() {
  setCrumbs([]);
  const run = await api("run");
  const keys = Object.keys(run.metrics);
  const order = [...PREFERRED.filter(k => keys.includes(k)), ...keys.filter(k => !PREFERRED.includes(k)).sort()];
  const steps = el("table", { id: "steps" }, el("tr", {}, el("th", { text: "step" }), el("th", { text: "dump size" })),
    run.steps.map(s => el("tr", {}, el("td", {}, el("a", { href: `#/step/${s.step}`, text: `step ${s.step}` })),
      el("td", { class: "num", text: `${(s.bytes / 1e6).toFixed(2)} MB` }))));
  const main = order.slice(0, 8), rest = order.slice(8);
  fill(view, 
    el("h1", { text: `run ${run.name}` }),
    el("h2", { text: "metrics per step" + (run.bad_metric_lines ? ` (${run.bad_metric_lines} unreadable lines left out)` : "") }),
    keys.length ? el("div", { class: "plots", id: "plots" }, main.map(k => plot(k, run.metrics[k]))) : el("p", { class: "muted", text: "no metrics.jsonl yet" }),
    rest.length ? el("details", {}, el("summary", { text: `${rest.length} more metrics` }), el("div", { class: "plots" }, rest.map(k => plot(k, run.metrics[k])))) : null,
    el("h2", { text: "steps with a credit dump" }),
    run.steps.length ? steps : el("p", { class: "muted", text: "no credit/step_NNNNN.json: run with --dump-credit" }));
}

async function stepPage(step, offset = 0) {
  setCrumbs([[`step ${step}`, `#/step/${step}`]]);
  const s = await api("step", { step, offset, limit: 100 });
  const rows = s.groups.map(g => el("tr", { "data-group": g.group },
    el("td", {}, el("a", { href: `#/step/${step}/group/${enc(g.group)}`, text: g.group })),
    el("td", { text: g.data_source }), el("td", { class: "num", text: g.rollouts }), el("td", { class: "num", text: g.turns }),
    el("td", { class: "rewards", text: g.rewards.map(r => fmt(r, 2)).join(" ") }), el("td", { class: "num", text: fmt(g.adv_mean, 4) })));
  fill(view, 
    el("h1", { text: `step ${s.step} · ${s.method}` }),
    el("p", { class: "muted", text: `${s.rows} turns, up to ${s.tokens} response tokens each; teacher: ${s.has_teacher ? "yes" : "no"}; texts and token ids: ${s.has_display ? "yes" : "no (an older dump)"}` }),
    el("table", { id: "groups" }, el("tr", {}, ["group", "source", "rollouts", "turns", "rewards", "mean advantage"].map(t => el("th", { text: t }))), rows),
    pager(offset, 100, s.total_groups, o => stepPage(step, o)),
    el("details", {}, el("summary", { text: "credit config" }), el("pre", { text: JSON.stringify(s.config, null, 1) })));
}

function pager(offset, limit, total, go) {
  if (total <= limit) return null;
  return el("div", { class: "pager" },
    el("button", { disabled: offset === 0 ? "" : null, on: { click: () => go(Math.max(0, offset - limit)) }, text: "previous" }),
    `${offset + 1}-${Math.min(total, offset + limit)} of ${total}`,
    el("button", { disabled: offset + limit >= total ? "" : null, on: { click: () => go(offset + limit) }, text: "next" }));
}

function turnCard(t) {
  const line = (k, v) => v === null || v === undefined ? null : el("div", {}, el("span", { class: "k", text: k + " " }), v);
  const src = t.sources && t.sources.length ? t.sources.map(s => `${s.rollout}#${s.turn} (${fmt(s.weight, 2)})`).join(", ") : (t.sources ? "none" : null);
  const cls = ["turn", t.valid ? "" : "invalid", t.span_start ? "span-start" : ""].join(" ");
  return el("div", { class: cls, "data-turn": t.turn, "data-row": t.row, style: `border-left-color:${advColor(t.adv_mean, 1)}` },
    el("div", {}, el("b", { text: `turn ${t.turn} ` }), el("span", { class: t.valid ? "badge" : "badge bad", text: t.valid ? "valid" : "invalid" }),
      t.span !== null && t.span !== undefined ? el("span", { class: "badge", text: `span ${t.span}${t.boundary ? " · " + t.boundary : ""}` }) : null),
    t.action !== null ? line("action", el("b", { text: t.action || "(none)" })) : null,
    t.thinking ? line("thinking", el("span", { class: "think", text: t.thinking })) : null,
    line("adv", el("span", { class: "adv", text: `${fmt(t.adv_mean, 4)} mean, ${fmt(t.adv_sum, 3)} sum over ${t.tokens} tokens` })),
    line("gap", t.gap === null ? null : el("span", { class: "gap", text: fmt(t.gap, 4) })),
    line("rectified gap", t.rectified_gap === null ? null : el("span", { class: "rgap", text: fmt(t.rectified_gap, 4) })),
    line("sources", src === null ? null : el("span", { class: "sources", text: src })),
    line("belief", t.belief_after === null ? null : el("span", { class: "belief", text: `${fmt(t.belief_before, 4)} → ${fmt(t.belief_after, 4)}` })),
    line("residual", t.residual === null ? null : el("span", { class: "residual", text: fmt(t.residual, 4) })),
    t.observation ? line("observation", el("span", { class: "obs", text: t.observation })) : null);
}

async function groupPage(step, group, offset = 0) {
  const base = `#/step/${step}/group/${enc(group)}`;
  setCrumbs([[`step ${step}`, `#/step/${step}`], [`group ${group}`, base]]);
  const g = await api("group", { step, group, offset, limit: 50 });
  const longest = Math.max(...g.trajectories.map(t => t.total_turns));
  fill(view, 
    el("h1", { text: `step ${step} · group ${group} · ${g.method}` }),
    // The objective only when the opening does not already state it (TextWorld's does).
    g.objective && !(g.opening || "").includes(g.objective) ? el("p", { id: "objective" }, el("span", { class: "k", text: "objective " }), g.objective) : null,
    g.opening ? el("details", { id: "opening", open: "" }, el("summary", { text: "opening: what the student read before its first turn" }),
      el("pre", { class: "obs", text: g.opening })) : null,
    el("p", {}, el("a", { id: "compare-link", href: `${base}/compare`, text: "compare with another method or settings →" })),
    g.extras_error ? el("p", { class: "error", text: `the ${g.method} intermediates could not be recomputed: ${g.extras_error}` }) : null,
    el("div", { class: "grid", id: "trajectories" }, g.trajectories.map(t => el("div", { class: "traj", "data-rollout": t.rollout },
      el("h2", {}, el("a", { href: `${base}/traj/${enc(t.rollout)}`, text: t.rollout }), " ",
        el("span", { class: t.reward > 0 ? "badge win" : "badge", text: `reward ${fmt(t.reward, 2)}` })),
      t.turns.map(turnCard)))),
    pager(offset, 50, longest, o => groupPage(step, group, o)));
}

async function trajPage(step, group, rollout, offset = 0) {
  const base = `#/step/${step}/group/${enc(group)}`;
  setCrumbs([[`step ${step}`, `#/step/${step}`], [`group ${group}`, base], [rollout, `${base}/traj/${enc(rollout)}`]]);
  const t = await api("trajectory", { step, group, rollout, offset, limit: 20 });
  const all = t.turns.flatMap(u => u.tokens.filter(k => k.on).map(k => Math.abs(k.adv)));
  const scale = Math.max(1e-9, ...all);
  fill(view, 
    el("h1", { text: `${rollout} · reward ${fmt(t.reward, 2)} · ${t.method}` }),
    el("p", { class: "muted", text: `${t.decoded ? "token text from the run's tokenizer" : "token ids (no tokenizer in the run's checkpoint/ or no ids in the dump)"}; colour: advantage (green > 0, red < 0, full at |a| = ${fmt(scale, 4)}); hover a token for its values` }),
    t.turns.map(u => el("div", { class: "tokens", "data-turn": u.turn },
      el("div", { class: "k" }, el("b", { text: `turn ${u.turn} ` }), u.valid ? "" : el("span", { class: "badge bad", text: "invalid" })),
      u.tokens.map(k => el("span", {
        class: k.on ? "tok" : "tok off", "data-adv": k.adv,
        title: `advantage ${k.adv}\nstudent log-prob ${fmt(k.student, 4)}` + (k.teacher === null ? "" : `\nteacher log-prob ${fmt(k.teacher, 4)}`) + (k.id === null ? "" : `\nid ${k.id}`) + (k.on ? "" : "\n(not trained on)"),
        style: k.on ? `background:${advColor(k.adv, scale)}` : null, text: k.text })))),
    pager(offset, 20, t.total_turns, o => trajPage(step, group, rollout, o)));
}

async function comparePage(step, group, query) {
  const base = `#/step/${step}/group/${enc(group)}`;
  setCrumbs([[`step ${step}`, `#/step/${step}`], [`group ${group}`, base], ["compare", `${base}/compare`]]);
  const [{ methods }, s] = await Promise.all([api("methods"), api("step", { step, limit: 1 })]);
  const method = query.get("method") || (s.method === "grpo" ? "grpo_opd" : "grpo");
  const overrides = query.get("overrides") || "{}";
  const sel = el("select", { id: "method" }, methods.map(m => el("option", { value: m, selected: m === method ? "" : null, text: m })));
  const over = el("textarea", { id: "overrides" });
  over.value = overrides;
  const form = el("form", { id: "compare-form", on: { submit: e => { e.preventDefault(); location.hash = `${base}/compare?` + new URLSearchParams({ method: sel.value, overrides: over.value }); } } },
    el("label", {}, "method ", sel), " ", el("label", {}, "settings (JSON, over the dump's credit config) ", over), el("button", { type: "submit", text: "recompute" }));
  const out = el("div", { id: "compare-result" }, el("p", { class: "muted", text: "recomputing..." }));
  fill(view, el("h1", { text: `step ${step} · group ${group}: ${s.method} (dumped) vs another` }), form, out);
  try {
    const c = await api("compare", { step, group, method, overrides });
    const scale = Math.max(1e-9, ...c.trajectories.flatMap(t => t.turns.flatMap(u => [Math.abs(u.dumped), Math.abs(u.replayed)])));
    const bar = x => el("span", { class: "bar", style: `width:${Math.round(40 * Math.abs(x) / scale)}px;background:${advColor(x, scale)}` });
    fill(out, 
      el("p", { id: "compare-summary", text: `${c.dumped_method} (as trained) vs ${c.method} ${JSON.stringify(c.overrides)}: max |difference| ${fmt(c.max_abs_diff, 4)} over the step's loss tokens, correlation ${c.correlation === null ? "–" : fmt(c.correlation, 3)}` }),
      el("div", { class: "grid" }, c.trajectories.map(t => el("div", { class: "traj", "data-rollout": t.rollout },
        el("h2", { text: `${t.rollout} · reward ${fmt(t.reward, 2)}` }),
        el("table", { class: "cmp" }, el("tr", {}, el("th", { text: "turn" }), el("th", { text: c.dumped_method }), el("th", { text: c.method })),
          t.turns.map(u => el("tr", { "data-turn": u.turn }, el("td", { text: u.turn }),
            el("td", { class: "num dumped" }, fmt(u.dumped, 4), " ", bar(u.dumped)),
            el("td", { class: "num replayed" }, fmt(u.replayed, 4), " ", bar(u.replayed)))))))));
  } catch (e) {
    fill(out, el("p", { class: "error", text: e.message }));
  }
}

async function route() {
  const [path, qs] = (location.hash.slice(1) || "/").split("?");
  const p = path.split("/").filter(Boolean).map(decodeURIComponent);
  const query = new URLSearchParams(qs || "");
  try {
    if (p.length === 0) await runPage();
    else if (p[0] === "step" && p.length === 2) await stepPage(p[1]);
    else if (p[0] === "step" && p[2] === "group" && p.length === 4) await groupPage(p[1], p[3]);
    else if (p[0] === "step" && p[2] === "group" && p[4] === "traj" && p.length === 6) await trajPage(p[1], p[3], p[5]);
    else if (p[0] === "step" && p[2] === "group" && p[4] === "compare") await comparePage(p[1], p[3], query);
    else throw new Error(`404: no page ${path}`);
  } catch (e) {
    fill(view, el("h1", { text: "cannot show this page" }), el("p", { class: "error", id: "error", text: e.message }),
      el("p", {}, el("a", { href: "#/", text: "back to the run" })));
  }
  document.body.dataset.ready = location.hash;  // tests wait for this
}

window.addEventListener("hashchange", route);
route();
