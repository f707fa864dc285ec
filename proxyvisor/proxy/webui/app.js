// proxyvisor web view: reads the proxy's JSON endpoints (proxyvisor/proxy/web.py) and follows its event stream.
// Everything shown comes from tool output, model text or the agent's requests: it is untrusted, so it only ever
// becomes text nodes (textContent, createTextNode), never markup.
"use strict";

const API = "/proxyvisor/ui/api/";
const STORE = window.sessionStorage;
let stream = null;     // the AbortController of the open event stream
let streamKey = "";    // which stream it is
let pending = null;    // the debounce timer of a refresh
let retryMs = 1000;

// ---- credentials and the view, from the URL fragment --------------------------------------------------------

function fragment() {
  // The fragment's key=value pairs, percent-decoded (a "+" stays a "+": a token may hold one).
  const out = new Map();
  for (const pair of location.hash.slice(1).split("&")) {
    if (!pair) continue;
    const at = pair.indexOf("=");
    const key = at < 0 ? pair : pair.slice(0, at), value = at < 0 ? "" : pair.slice(at + 1);
    try { out.set(decodeURIComponent(key), decodeURIComponent(value)); } catch (e) { out.set(key, value); }
  }
  return out;
}

function encode(params) {
  return Array.from(params, ([key, value]) => encodeURIComponent(key) + "=" + encodeURIComponent(value)).join("&");
}

function takeTokens() {
  // #admin=...&auth=... : kept in this tab's session storage, then removed from the address bar (and history).
  const params = fragment();
  let changed = false;
  for (const [key, name] of [["admin", "pv-admin"], ["auth", "pv-auth"]]) {
    if (params.has(key)) {
      STORE.setItem(name, params.get(key));
      params.delete(key);
      changed = true;
    }
  }
  if (changed) history.replaceState(null, "", location.pathname + (params.size ? "#" + encode(params) : ""));
}

function view() {
  const params = fragment();
  const session = params.get("session");
  if (session) return {name: "session", session};
  return {name: params.get("view") === "pools" ? "pools" : "sessions"};
}

function headers() {
  const out = {};
  if (STORE.getItem("pv-admin")) out["x-proxyvisor-admin"] = STORE.getItem("pv-admin");
  if (STORE.getItem("pv-auth")) out["x-proxyvisor-auth"] = STORE.getItem("pv-auth");
  return out;
}

async function getJSON(path) {
  const reply = await fetch(API + path, {headers: headers(), cache: "no-store"});
  let body = null;
  try { body = await reply.json(); } catch (e) { body = null; }
  if (!reply.ok) {
    const message = body && body.error && body.error.message ? body.error.message : "HTTP " + reply.status;
    throw new Error(message);
  }
  return body;
}

// ---- building the page: text only -----------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function badge(text, tone, test) {
  return el("span", {class: "badge " + (tone || "neutral"), "data-test": test}, text);
}

const TONES = {
  // self-reported states, gate outcomes and verdicts, breaker states, statuses
  progressing: "good", done: "good", verified: "good", pass: "good", healthy: "good", answered: "good",
  ok: "good", ready: "good",
  exploring: "info", unknown: "info", blocked: "warn", need_input: "warn", stuck: "bad",
  gaps: "warn", malformed: "warn", unavailable: "warn", unverified: "warn", half_open: "warn",
  failed: "bad", cooling_down: "bad", refused: "bad", error: "bad", cancelled: "neutral",
  loop: "bad", no_progress: "warn", recovery: "warn",
};

function tone(word) { return TONES[word] || "neutral"; }

function num(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }

function plural(n, noun, nouns) { return num(n) + " " + (n === 1 ? noun : nouns || noun + "s"); }

function shortCost(row) {
  // The listing's cost in a few characters; the whole sentence (what is not priced, and why) in its tooltip.
  const text = row.cost_usd > 0 ? "$" + row.cost_usd.toFixed(4) : row.cost ? "not priced" : "–";
  return el("span", {title: row.cost || null}, text + (row.cost_usd > 0 && /unknown|not priced/.test(row.cost) ? " +" : ""));
}

function when(iso) {
  if (!iso) return "–";
  const t = new Date(iso);
  if (isNaN(t)) return String(iso);
  const age = (Date.now() - t.getTime()) / 1000;
  const clock = t.toLocaleTimeString("en-GB", {hour12: false});
  if (age < 60) return clock + " (just now)";
  if (age < 3600) return clock + " (" + Math.round(age / 60) + " min ago)";
  return t.toISOString().replace("T", " ").slice(0, 19) + " UTC";
}

function counts(map, test) {
  const entries = Object.entries(map || {}).sort((a, b) => b[1] - a[1]);
  if (!entries.length) return el("span", {class: "muted"}, "–");
  return el("span", {class: "chips", "data-test": test},
            entries.map(([key, n]) => badge(key + " " + num(n), tone(key))));
}

function sessionLink(id) {
  return el("a", {href: "#" + encode([["session", id]]), class: "mono", "data-session-link": id}, id);
}

function notice(text, tone) { return el("p", {class: "notice " + (tone || ""), "data-test": "notice"}, text); }

function setMain(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.flat().filter(n => n !== null && n !== undefined && n !== false));
}

// ---- the sessions --------------------------------------------------------------------------------------

async function showSessions() {
  let data;
  try {
    data = await getJSON("sessions");
  } catch (e) {
    setMain(el("h1", {}, "Sessions"), notice(e.message, "bad"),
            el("p", {class: "muted"}, "Open a session you know: /proxyvisor/ui#session=ID. The listing needs the " +
               "admin token: /proxyvisor/ui#admin=TOKEN. Where the proxy has an auth token, add &auth=TOKEN " +
               "(both kept in this tab only)."));
    return;
  }
  const head = el("tr", {}, ["Session", "Agent", "Model", "Requests", "Tokens in / out", "Cost", "Last activity",
                             "State", "Gate outcomes", "Supervision"].map(h => el("th", {}, h)));
  const rows = data.sessions.map(s => el("tr", {"data-session": s.id},
    el("td", {class: "nowrap"}, sessionLink(s.id), s.in_memory ? badge("live", "info") : null),
    el("td", {class: "nowrap"}, s.agent || "–"),
    el("td", {class: "mono model"}, s.model || "–"),
    el("td", {class: "num"}, el("span", {"data-test": "requests"}, num(s.requests)),
       s.errors ? el("div", {}, badge(plural(s.errors, "error"), "bad")) : null),
    el("td", {class: "num"}, num(s.input_tokens) + " / " + num(s.output_tokens)),
    el("td", {class: "nowrap"}, s.error ? badge("unreadable", "bad") : shortCost(s)),
    el("td", {class: "nowrap"}, when(s.last_activity)),
    el("td", {}, s.state ? badge(s.state, tone(s.state), "state") : "–"),
    el("td", {}, counts(s.gate_outcomes, "gate-outcomes")),
    el("td", {}, counts(s.fires, "fires"),
       s.condensed ? badge("condensed " + num(s.condensed) + " · saved " + num(s.saved_tokens), "info") : null)));
  setMain(el("h1", {}, "Sessions"),
          data.sessions.length ? el("table", {class: "grid", "data-test": "sessions"}, el("thead", {}, head),
                                    el("tbody", {}, rows))
                               : notice("No session yet: point an agent at this proxy."),
          data.omitted ? el("p", {class: "muted"}, num(data.omitted) + " older sessions not listed") : null);
}

// ---- one session's timeline ----------------------------------------------------------------------------

function card(label, value, test) {
  return el("div", {class: "card", "data-test": test}, el("div", {class: "label"}, label), el("div", {class: "value"}, value));
}

function summary(info) {
  const gate = info.gate, up = info.upstream, cond = info.condense;
  return el("div", {class: "cards"},
    card("Model requests", num(info.requests) + (info.errors ? " (" + plural(info.errors, "error") + ")" : ""), "requests"),
    card("Tokens in / out", num(up.input_tokens) + " / " + num(up.output_tokens)),
    card("Detector fires", counts(info.detectors.fires, "fires")),
    card("Steer notes", counts(info.detectors.steers, "steers")),
    card("Condensed", plural(cond.results, "result") + " · " + num(cond.saved_tokens) + " tokens not sent", "condensed"),
    card("Gate", plural(gate.runs, "run") + " · " + plural(gate.reentries, "re-entry", "re-entries"), "gate"),
    card("Gate outcomes", counts(gate.outcomes, "gate-outcomes")),
    card("Supervisor model", plural(info.supervisor_model.total_calls, "call")));
}

function section(title, tone_, ...body) {
  return el("div", {class: "part " + (tone_ || "")}, el("div", {class: "part-title"}, title), ...body);
}

function step(e) {
  const failed = e.status >= 400;
  const head = el("div", {class: "step-head"},
    el("span", {class: "step-n"}, "#" + e.n),
    el("span", {class: "muted"}, when(e.time)),
    e.local ? badge("answered by proxyvisor: " + e.local, "info")
            : badge(String(e.status), failed ? "bad" : "good", "status"),
    e.model ? el("span", {class: "mono"}, e.model) : null,
    e.tool_round ? badge("tool round", "neutral", "tool-round") : null,
    e.report && e.report.state ? badge("state: " + e.report.state, tone(e.report.state), "report-state")
      : e.report ? badge("self-report " + e.report.status, tone(e.report.status), "report-state") : null,
    e.input_tokens !== null || e.output_tokens !== null
      ? el("span", {class: "muted"}, num(e.input_tokens) + " in / " + num(e.output_tokens) + " out") : null,
    e.condensed && !e.condensed.items.length && e.condensed.saved_tokens
      ? el("span", {class: "muted", title: "earlier condensed results, carried in this request"},
           "condensed: " + num(e.condensed.saved_tokens) + " tokens not sent") : null,
    el("span", {class: "muted", title: "the time proxyvisor itself added"}, "+" + e.overhead_ms.toFixed(1) + " ms"));
  const parts = [];
  if (e.error) parts.push(section("Error", "bad", el("div", {class: "text", "data-test": "error"}, e.error)));
  if (e.signals.length || e.steer) {
    parts.push(section("Detectors", "bad",
      el("div", {class: "chips"}, e.signals.map(s => badge("fired: " + s, tone(s), "fire"))),
      e.steer ? el("div", {}, el("span", {class: "muted"}, "steer note (" + e.steer.signal + "):"),
                   el("blockquote", {"data-test": "steer-note"}, e.steer.note || "(text not recorded)")) : null));
  }
  if (e.condensed && e.condensed.items.length) {
    parts.push(section("Condensed", "info",
      el("div", {class: "muted"}, plural(e.condensed.results, "result") + " narrowed for the model · " +
         num(e.condensed.saved_tokens) + " tokens not sent in this request"),
      e.condensed.items.map(i => el("div", {class: "item", "data-test": "condensed-item"},
        el("span", {class: "mono"}, i.tool || "?"), " ",
        badge(i.condenser || "condensed", "info"), " ",
        el("span", {"data-test": "condensed-tokens"}, num(i.tokens_before) + " → " + num(i.tokens_after) +
           " tokens (saved " + num(i.tokens_before - i.tokens_after) + ")"),
        i.spill_path ? el("div", {class: "mono small", "data-test": "spill-path"}, "full original: " + i.spill_path) : null))));
  }
  for (const d of e.delegations) {
    parts.push(section("Delegation: " + (d.role || "?"), tone(d.status),
      el("div", {}, badge(d.status || "?", tone(d.status), "delegation-status"), " ",
         el("span", {class: "mono"}, [d.adapter, d.model].filter(Boolean).join(" / ")),
         d.pool ? el("span", {class: "muted"}, " pool " + d.pool) : null,
         d.input_tokens !== null ? el("span", {class: "muted"}, " · " + num(d.input_tokens) + " in / " + num(d.output_tokens) + " out") : null,
         d.duration_s ? el("span", {class: "muted"}, " · " + d.duration_s.toFixed(1) + " s") : null),
      d.runs.length ? el("ol", {class: "runs"}, d.runs.map(r => el("li", {},
        "child run " + r.attempt + ": ", badge(r.outcome || "?", tone(r.outcome)),
        r.error_category ? el("span", {class: "muted"}, " " + r.error_category) : null))) : null,
      d.dead_letter ? el("div", {class: "mono small"}, "dead letter " + d.dead_letter) : null));
  }
  if (e.gate) {
    const g = e.gate;
    parts.push(section("Verify-gate", g.outcome ? tone(g.outcome) : "warn",
      el("div", {class: "chips"},
         g.verdicts.map((v, i) => badge(v + (g.decided_by[i] ? " (" + g.decided_by[i] + ")" : ""), tone(v), "verdict")),
         g.outcome ? badge("outcome: " + g.outcome, tone(g.outcome), "gate-outcome") : badge("turn goes on", "info", "gate-outcome"),
         g.reentries ? badge(plural(g.reentries, "re-entry", "re-entries"), "warn", "reentries") : null,
         g.nudges ? badge(plural(g.nudges, "nudge"), "warn") : null,
         g.refuted ? badge(num(g.refuted) + " refuted", "info") : null),
      g.gaps.length ? el("ul", {class: "gaps", "data-test": "gaps"}, g.gaps.map(t => el("li", {}, t))) : null,
      g.reason ? el("div", {class: "muted small"}, g.reason) : null));
  }
  if (e.upstream && (e.upstream.tried.length || e.upstream.outcome !== "answered")) {
    parts.push(section("Upstream", tone(e.upstream.outcome),
      el("div", {}, badge(e.upstream.outcome || "?", tone(e.upstream.outcome)), " ",
         el("span", {class: "mono"}, e.upstream.pool || e.upstream.name || "")),
      e.upstream.tried.map(t => el("div", {class: "muted small"},
        "tried first: " + (t.pool || t.name) + " (" + (t.status || "no reply") + (t.error_category ? ", " + t.error_category : "") + ")"))));
  }
  if (e.authorizer && (e.authorizer.blocked || e.authorizer.checked)) {
    parts.push(section("Authorizer", e.authorizer.blocked ? "bad" : "info",
      el("div", {}, num(e.authorizer.checked) + " checked · " + num(e.authorizer.blocked) + " blocked")));
  }
  return el("li", {class: "step" + (failed ? " failed" : ""), "data-n": e.n}, head, parts);
}

async function showSession(id) {
  let data;
  try {
    data = await getJSON("sessions/" + encodeURIComponent(id));
  } catch (e) {
    setMain(el("h1", {}, "Session ", el("span", {class: "mono"}, id)), notice(e.message, "bad"));
    return;
  }
  const plan = data.plan && data.plan.plan ? el("pre", {class: "plan", "data-test": "plan"}, data.plan.text) : null;
  setMain(
    el("p", {class: "crumbs"}, el("a", {href: "#"}, "Sessions"), " / "),
    el("h1", {}, "Session ", el("span", {class: "mono", "data-test": "session-id"}, data.session),
       data.in_memory ? badge("live in this proxy", "info") : badge("from the ledger", "neutral", "from-ledger")),
    summary(data.info),
    plan ? el("h2", {}, "Plan") : null, plan,
    el("h2", {}, "Timeline"),
    data.omitted ? el("p", {class: "muted"}, num(data.omitted) + " earlier requests not shown") : null,
    data.timeline.length ? el("ol", {class: "timeline", "data-test": "timeline"}, data.timeline.map(step))
                         : notice("No request recorded yet."));
}

// ---- pools and routing ---------------------------------------------------------------------------------

async function showPools() {
  let data;
  try {
    data = await getJSON("overview");
  } catch (e) {
    setMain(el("h1", {}, "Pools & routing"), notice(e.message, "bad"));
    return;
  }
  const pools = data.health.pools;
  const poolTable = pools.length ? el("table", {class: "grid", "data-test": "pools"},
    el("thead", {}, el("tr", {}, ["Pool", "Breaker", "Failures in a row", "Recovers", "Last failure"].map(h => el("th", {}, h)))),
    el("tbody", {}, pools.map(p => el("tr", {"data-pool": p.pool},
      el("td", {class: "mono"}, p.pool),
      el("td", {}, badge(p.state, tone(p.state), "breaker"), p.probe_in_flight ? badge("probe in flight", "warn") : null),
      el("td", {class: "num"}, num(p.failure_count)),
      el("td", {}, p.recovers_in_s !== null ? "in " + p.recovers_in_s + " s" : "–"),
      el("td", {}, p.last_category || "–")))))
    : notice("No pool has recorded a failure: every pool is healthy.");
  const r = data.routing, policy = r.policy;
  const roles = Object.keys(policy.roles);
  const roleTable = roles.length ? el("table", {class: "grid", "data-test": "roles"},
    el("thead", {}, el("tr", {}, ["Role", "Resolves to", "Pool", "Supervises"].map(h => el("th", {}, h)))),
    el("tbody", {}, roles.map(name => {
      const route = r.resolved[name] || {};
      return el("tr", {"data-role": name}, el("td", {}, name),
        el("td", {class: "mono"}, route.unavailable ? badge("unavailable: " + route.unavailable, "bad")
                                   : [route.adapter, route.model || "(runtime default)", route.effort].filter(Boolean).join(" / ")),
        el("td", {class: "mono"}, route.capacity_scope || "–"),
        el("td", {}, (policy.roles[name].supervises || []).join(", ") || "–"));
    })))
    : notice("No role is configured (proxyvisor routing set --role R ...).");
  const adapters = el("table", {class: "grid", "data-test": "adapters"},
    el("thead", {}, el("tr", {}, ["Adapter", "Readiness", "Models", "Capabilities"].map(h => el("th", {}, h)))),
    el("tbody", {}, Object.entries(r.adapters).map(([id, a]) => el("tr", {"data-adapter": id},
      el("td", {class: "mono"}, id),
      el("td", {}, a.ready ? badge("ready", "good", "readiness") : badge("unavailable", "bad", "readiness"),
         a.unavailable ? el("div", {class: "muted small"}, a.unavailable) : null),
      el("td", {class: "mono small"}, a.models.map(m => m.id).join(", ") || "any"),
      el("td", {class: "small"}, a.capabilities.join(", "))))));
  setMain(el("h1", {}, "Pools & routing"),
    el("p", {class: "muted"}, "Supervision " + (data.supervision ? "on" : "off") + " · rate-limit breakers " +
       (data.breakers ? "on" : "off") + " · upstreams: " + data.upstreams.map(u => u.name +
       (u.fallback.length ? " (fallback " + u.fallback.join(", ") + ")" : "")).join(", ")),
    el("h2", {}, "Breakers"), poolTable,
    el("h2", {}, "Routing policy"),
    el("div", {class: "cards"},
       card("Delegation", r.enabled ? badge("enabled", "good", "delegation") : badge("disabled", "neutral", "delegation")),
       card("Mode", policy.mode), card("Complexity threshold", policy.complexity_threshold),
       card("Fallback", policy.fallback_policy), card("Max parallel", num(policy.max_parallel))),
    roleTable, el("h2", {}, "Adapters"), adapters);
}

// ---- live updates --------------------------------------------------------------------------------------

function setLive(on, text) {
  const live = document.getElementById("live");
  live.className = "live " + (on ? "on" : "off");
  live.textContent = text;
}

let lastEventRender = 0;

function refresh() {
  // A burst of events is one read, and a busy proxy is read at most once a second.
  if (pending) return;
  const wait = Math.max(150, 1000 - (Date.now() - lastEventRender));
  pending = setTimeout(() => { pending = null; lastEventRender = Date.now(); render(); }, wait);
}

async function follow(path) {
  // Server-Sent Events read with fetch, which can send the headers EventSource cannot.
  const controller = new AbortController();
  stream = controller;
  try {
    const reply = await fetch(API + path, {headers: headers(), signal: controller.signal, cache: "no-store"});
    if (!reply.ok) {
      setLive(false, reply.status === 403 ? "no live updates (admin token needed)" : "no live updates (" + reply.status + ")");
      return;
    }
    const reader = reply.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const name = (block.match(/^event: ?(.*)$/m) || [])[1];
        if (name === "ready") {
          retryMs = 1000;
          setLive(true, "live");
          refresh();   // connected (again: maybe to a restarted proxy): read everything afresh
        } else if (name === "ledger" || name === "resync") {
          document.body.dataset.events = String(Number(document.body.dataset.events || 0) + 1);
          refresh();
        }
      }
    }
  } catch (e) {
    if (controller.signal.aborted) return;
  }
  if (stream !== controller) return;
  setLive(false, "reconnecting");
  setTimeout(() => { if (stream === controller) follow(path); }, retryMs);
  retryMs = Math.min(retryMs * 2, 10000);
}

function listen(v) {
  const key = v.name === "session" ? "sessions/" + encodeURIComponent(v.session) + "/events" : "events";
  if (key === streamKey && stream) return;
  if (stream) stream.abort();
  streamKey = key;
  follow(key);
}

// ---- routing -------------------------------------------------------------------------------------------

let rendering = Promise.resolve();

function render() {
  const v = view();
  document.getElementById("nav-sessions").className = v.name === "pools" ? "" : "current";
  document.getElementById("nav-pools").className = v.name === "pools" ? "current" : "";
  rendering = rendering.then(async () => {
    if (v.name === "session") await showSession(v.session);
    else if (v.name === "pools") await showPools();
    else await showSessions();
    document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
  });
  return rendering;
}

function start() {
  takeTokens();
  render();
  listen(view());
}

window.addEventListener("hashchange", () => { takeTokens(); render(); listen(view()); });
document.addEventListener("DOMContentLoaded", start);
