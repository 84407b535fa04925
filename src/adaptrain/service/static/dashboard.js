// The adaptrain dashboard: the jobs, the cluster's slots and each job's history, read from the
// service's JSON API and redrawn in place every poll (no reload). Charts are plain SVG drawn
// here. Every text from the server goes into the page as text (textContent), never as HTML.
(() => {
  "use strict";

  const TOKEN_KEY = "adaptrain-token";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const LOG_TAIL = 16384;
  const FAILURE_KINDS = new Set(["ReplicaFailed", "Failed", "Killed"]);

  const state = {
    token: sessionStorage.getItem(TOKEN_KEY),
    period: 2000, // ms between polls: at most half a scheduling round, at most 2 s
    timer: null,
    generation: 0, // a poll whose generation is stale (the view changed) draws nothing
    route: null,
    rounds: [], // the cluster's rounds seen so far
    job: null, // {name, samples, tb} of the job page
    logRank: "0",
  };

  // ---- small DOM helpers ----------------------------------------------------------------
  const $ = (selector) => document.querySelector(selector);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child !== null && child !== undefined) {
        node.append(child instanceof Node ? child : String(child));
      }
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---- formatting -------------------------------------------------------------------------
  function fmtNum(value, digits = 3) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    const abs = Math.abs(value);
    if (abs >= 1e6) return (value / 1e6).toPrecision(digits) + "M";
    if (abs >= 1e4) return (value / 1e3).toPrecision(digits) + "k";
    if (abs >= 100 || Number.isInteger(value)) return String(Math.round(value));
    return String(Number(value.toPrecision(digits)));
  }

  function fmtDuration(seconds) {
    const s = Math.max(0, Math.floor(seconds || 0));
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
    return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  }

  function fmtClock(t) {
    return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
  }

  // A job's colour: its name hashed to a hue, spread by the golden angle.
  function colour(name) {
    let h = 0;
    for (const c of name) h = (h * 31 + c.charCodeAt(0)) >>> 0;
    return `hsl(${(h * 137.508) % 360}, 62%, 50%)`;
  }

  // ---- the API ----------------------------------------------------------------------------
  class AuthError extends Error {}

  async function api(path) {
    const headers = {};
    if (state.token) headers.Authorization = `Bearer ${state.token}`;
    let resp;
    try {
      resp = await fetch(path, { headers, cache: "no-store" });
    } catch (err) {
      throw new Error("the server cannot be reached; retrying");
    }
    if (resp.ok) return resp;
    let detail = resp.statusText;
    try {
      const body = await resp.json();
      detail = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
    } catch (err) {
      // not JSON: the status text says it
    }
    if (resp.status === 401) throw new AuthError(detail);
    throw new Error(`${resp.status}: ${detail}`);
  }

  const getJSON = async (path) => (await api(path)).json();

  // ---- sign-in ----------------------------------------------------------------------------
  function showLogin(detail) {
    clearTimeout(state.timer);
    state.generation += 1;
    // a refused request shows no data: whatever the view held is dropped
    $("#view").replaceChildren();
    $("#view").hidden = true;
    $("#cluster-summary").textContent = "";
    $("#login").hidden = false;
    $("#logout").hidden = true;
    const message = state.token
      ? `The server refused this token (401: ${detail}). Check it and sign in again.`
      : "This server needs a token: enter the one in its --token-file to see its jobs.";
    $("#login-error").textContent = message;
    setStatus("");
    $("#token").focus();
  }

  function showApp() {
    $("#login").hidden = true;
    $("#view").hidden = false;
    $("#logout").hidden = !state.token;
  }

  function setStatus(text, bad) {
    const line = $("#status-line");
    line.textContent = text;
    line.classList.toggle("bad", Boolean(bad));
  }

  // ---- routing ----------------------------------------------------------------------------
  function parseRoute() {
    const m = /^#\/jobs\/([a-z0-9-]{1,63})$/.exec(location.hash);
    return m ? { view: "job", name: m[1] } : { view: "jobs" };
  }

  function navigate() {
    state.route = parseRoute();
    state.rounds = [];
    state.job = null;
    if (state.route.view === "job") buildJobView(state.route.name);
    else buildJobsView();
    refresh();
  }

  async function refresh() {
    clearTimeout(state.timer);
    const generation = ++state.generation;
    try {
      if (state.route.view === "job") await refreshJob(state.route.name, generation);
      else await refreshJobs(generation);
      if (generation !== state.generation) return;
      showApp();
      setStatus(`updated ${fmtClock(Date.now() / 1000)}`);
    } catch (err) {
      if (generation !== state.generation) return;
      if (err instanceof AuthError) {
        showLogin(err.message);
        return;
      }
      setStatus(err.message, true);
    }
    if (generation === state.generation) state.timer = setTimeout(refresh, state.period);
  }

  function setPeriod(interval) {
    // within one scheduling round: at most half of it, between 0.5 and 2 s
    state.period = Math.round(1000 * Math.min(2, Math.max(0.5, interval / 2)));
  }

  // ---- the jobs page (jobs and cluster) -----------------------------------------------------
  const JOB_COLUMNS = [
    ["name", "Name"],
    ["status", "Status"],
    ["replicas", "Replicas"],
    ["restarts", "Restarts"],
    ["batch_size", "Batch size"],
    ["gain", "Gain"],
    ["goodput", "Goodput"],
    ["speedup", "Speedup"],
    ["runtime", "Runtime"],
  ];

  function buildJobsView() {
    const head = el("tr", null, ...JOB_COLUMNS.map(([key, label]) => el("th", { text: label, "data-col": key })));
    $("#view").replaceChildren(
      el(
        "section",
        { id: "jobs-section" },
        el("h2", { text: "Jobs" }),
        el("table", { id: "jobs" }, el("thead", null, head), el("tbody")),
        el("p", { id: "no-jobs", class: "muted", hidden: "" }, "No jobs yet: ", el("code", { text: "adaptrain submit -- python train.py" })),
      ),
      el(
        "section",
        { id: "cluster-section" },
        el("h2", { text: "Cluster" }),
        el("div", { id: "slots" }),
        el("div", { id: "legend" }),
        el("div", { id: "util-chart", class: "charts" }),
      ),
    );
  }

  async function refreshJobs(generation) {
    const since = state.rounds.length ? state.rounds[state.rounds.length - 1].time : null;
    const [jobs, slots, history] = await Promise.all([
      getJSON("jobs"),
      getJSON("cluster/slots"),
      getJSON("cluster/history" + (since === null ? "" : `?since=${since}`)),
    ]);
    if (generation !== state.generation) return;
    setPeriod(slots.interval);
    state.rounds = state.rounds.concat(history.rounds).slice(-1000);
    drawJobsTable(jobs);
    drawSlots(slots);
    drawUtilisation(slots);
  }

  function cell(job, key) {
    const value = job[key];
    switch (key) {
      case "name":
        return el("td", { class: "name" }, el("a", { href: `#/jobs/${job.name}`, text: job.name }));
      case "status":
        return el("td", { class: "status" }, el("span", { class: `badge ${job.status}`, text: job.status, title: job.reason || "" }));
      case "gain":
        return el("td", { class: "num gain", text: value === null ? "–" : value.toFixed(2) });
      case "speedup":
        return el("td", { class: "num speedup", text: value === null ? "–" : `${value.toFixed(2)}×` });
      case "runtime":
        return el("td", { class: "num runtime", text: fmtDuration(value) });
      default:
        return el("td", { class: `num ${key}`, text: fmtNum(value) });
    }
  }

  function drawJobsTable(jobs) {
    const rows = jobs.map((job) => {
      const row = el("tr", { "data-job": job.name, "data-status": job.status, tabindex: "0" }, ...JOB_COLUMNS.map(([key]) => cell(job, key)));
      const open = () => {
        location.hash = `#/jobs/${job.name}`;
      };
      row.addEventListener("click", open);
      row.addEventListener("keydown", (e) => {
        if (e.key === "Enter") open();
      });
      return row;
    });
    $("#jobs tbody").replaceChildren(...rows);
    $("#no-jobs").hidden = jobs.length > 0;
    const counts = {};
    for (const job of jobs) counts[job.status] = (counts[job.status] || 0) + 1;
    $("#cluster-summary").textContent = Object.entries(counts)
      .map(([status, n]) => `${n} ${status}`)
      .join(" · ");
  }

  function drawSlots(cluster) {
    const used = new Set();
    const nodes = cluster.nodes.map((node) => {
      const slots = node.slots.map((holder, i) => {
        if (holder) used.add(holder);
        const box = el("a", {
          class: holder ? "slot held" : "slot",
          "data-job": holder || "",
          title: `${node.name} slot ${i}: ${holder || "free"}`,
          href: holder ? `#/jobs/${holder}` : null,
        });
        if (holder) box.style.background = colour(holder);
        return box;
      });
      const reserved = node.reserved ? el("span", { class: "muted", text: ` +${node.reserved} reserved` }) : null;
      return el("div", { class: "node", "data-node": node.name }, el("span", { class: "node-name", text: node.name }), el("span", { class: "node-slots" }, ...slots), reserved);
    });
    $("#slots").replaceChildren(...nodes);
    for (const r of state.rounds) for (const name of Object.keys(r.jobs)) used.add(name);
    const legend = [...used].sort().map((name) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = colour(name);
      return el("a", { class: "legend-item", href: `#/jobs/${name}` }, swatch, name);
    });
    const total = cluster.nodes.reduce((n, node) => n + node.slots.length, 0);
    const held = cluster.nodes.reduce((n, node) => n + node.slots.filter(Boolean).length, 0);
    $("#legend").replaceChildren(
      el("span", { class: "muted", text: `${held} of ${total} slots held · ${cluster.policy} policy, round ${cluster.round} every ${cluster.interval} s  ` }),
      ...legend,
    );
  }

  function drawUtilisation(cluster) {
    const rounds = state.rounds;
    const names = [...new Set(rounds.flatMap((r) => Object.keys(r.jobs)))].sort();
    const mean = rounds.length ? rounds.reduce((s, r) => s + r.used / Math.max(1, r.total), 0) / rounds.length : null;
    const total = rounds.length ? Math.max(...rounds.map((r) => r.total)) : null;
    const figure = stackChart({
      key: "utilisation",
      title: "Utilisation: slots held per job, each round",
      caption: mean === null ? "" : `mean ${(100 * mean).toFixed(0)}% of ${total} slots`,
      times: rounds.map((r) => r.time),
      layers: names.map((name) => ({ name, colour: colour(name), values: rounds.map((r) => r.jobs[name] || 0) })),
      total,
    });
    $("#util-chart").replaceChildren(figure);
  }

  // ---- the job page -----------------------------------------------------------------------
  const JOB_CHARTS = [
    ["replicas", "Allocation (replicas)", true],
    ["batch_size", "Batch size", true],
    ["gain", "Gain", false],
    ["goodput", "Goodput", false],
    ["throughput", "Throughput (samples/s)", false],
  ];

  function buildJobView(name) {
    const rankSelect = el(
      "select",
      { id: "log-rank", "aria-label": "log of" },
      el("option", { value: "0", text: "rank 0" }),
      el("option", { value: "all", text: "all ranks" }),
    );
    rankSelect.value = state.logRank;
    rankSelect.addEventListener("change", () => {
      state.logRank = rankSelect.value;
      refresh();
    });
    $("#view").replaceChildren(
      el("nav", null, el("a", { href: "#/", text: "← all jobs" })),
      el(
        "section",
        { id: "job-section" },
        el("h2", { id: "job-title" }, el("span", { id: "job-name", text: name }), " ", el("span", { id: "job-status", class: "badge" })),
        el("p", { id: "job-reason", hidden: "" }),
        el("dl", { id: "job-stats" }),
        el("p", { id: "job-tensorboard" }),
      ),
      el("div", { id: "job-charts", class: "charts" }),
      el("section", null, el("h3", { text: "Events" }), el("table", { id: "events" }, el("thead", null, el("tr", null, el("th", { text: "Time" }), el("th", { text: "Event" }), el("th", { text: "Detail" }))), el("tbody"))),
      el("section", null, el("h3", null, "Logs ", rankSelect), el("pre", { id: "logs" })),
    );
    state.job = { name, samples: [], tb: null };
  }

  async function refreshJob(name, generation) {
    const job = state.job;
    const since = job.samples.length ? job.samples[job.samples.length - 1].time : null;
    const rank = state.logRank === "all" ? "" : `&rank=${state.logRank}`;
    const [detail, history, logs] = await Promise.all([
      getJSON(`jobs/${name}`),
      getJSON(`jobs/${name}/history` + (since === null ? "" : `?since=${since}`)),
      api(`jobs/${name}/logs?tail=${LOG_TAIL}${rank}`).then((r) => r.text()),
    ]);
    if (generation !== state.generation) return;
    job.samples = job.samples.concat(history.samples).slice(-2000);
    job.tb = history.tensorboard_logdir;
    drawJobHeader(detail);
    drawJobCharts(job.samples);
    drawEvents(detail.events);
    drawLogs(logs);
  }

  function drawJobHeader(d) {
    const badge = $("#job-status");
    badge.textContent = d.status;
    badge.className = `badge ${d.status}`;
    const reason = d.status === "Pending" ? d.pending_reason : d.reason;
    const reasonLine = $("#job-reason");
    reasonLine.hidden = !reason;
    reasonLine.textContent = reason ? (d.status === "Pending" ? `Pending: ${reason}` : reason) : "";
    const counts = {};
    for (const node of d.allocation) counts[node] = (counts[node] || 0) + 1;
    const allocation = Object.entries(counts).map(([node, n]) => `${node} × ${n}`).join(", ") || "none";
    const stats = [
      ["Replicas", `${d.replicas} (min ${d.min_replicas}, max ${d.max_replicas})`],
      ["Allocation", allocation],
      ["Batch size", fmtNum(d.batch_size)],
      ["Gain", d.gain === null ? "–" : d.gain.toFixed(2)],
      ["Goodput", fmtNum(d.goodput)],
      ["Throughput", fmtNum(d.hints ? d.hints.throughput : null)],
      ["Speedup", d.speedup === null ? "–" : `${d.speedup.toFixed(2)}×`],
      ["Restarts", `${d.restarts} (${d.failures} after failures, budget ${d.max_restarts})`],
      ["Runtime", fmtDuration(d.runtime)],
      ["Submitted", new Date(d.submitted * 1000).toLocaleString()],
      ["Command", d.command.join(" ")],
    ];
    $("#job-stats").replaceChildren(...stats.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v, "data-stat": k.toLowerCase().replace(" ", "-") })]));
    const tb = $("#job-tensorboard");
    const url = `${location.protocol}//${location.hostname}:6006/#timeseries&runFilter=${encodeURIComponent(d.name)}`;
    tb.replaceChildren(
      "TensorBoard: ",
      el("a", { href: url, target: "_blank", rel: "noopener noreferrer", id: "tensorboard-link", text: url }),
      " (start it with ",
      el("code", { text: "adaptrain tensorboard --state-dir DIR" }),
      "; this job's events are in ",
      el("code", { text: state.job.tb || "–" }),
      ")",
    );
  }

  function drawJobCharts(samples) {
    // one time axis for all the job's charts, so that they line up
    const span = samples.length ? [samples[0].time, samples[samples.length - 1].time] : null;
    const figures = JOB_CHARTS.map(([key, title, step]) => {
      const points = samples.filter((s) => s[key] !== null && s[key] !== undefined).map((s) => [s.time, s[key]]);
      return lineChart({ key, title, step, points, span, colour: colour(state.job.name) });
    });
    $("#job-charts").replaceChildren(...figures);
  }

  function drawEvents(events) {
    const rows = events
      .slice()
      .reverse()
      .map((e) => {
        let kind = "";
        if (FAILURE_KINDS.has(e.kind)) kind = "failure";
        else if (e.message.startsWith("rescale")) kind = "rescale";
        else if (e.kind === "Started") kind = "started";
        return el("tr", { class: kind, "data-kind": e.kind }, el("td", { class: "time", text: fmtClock(e.time) }), el("td", { text: e.kind }), el("td", { text: e.message }));
      });
    $("#events tbody").replaceChildren(...rows);
  }

  function drawLogs(text) {
    const pre = $("#logs");
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    if (pre.textContent !== text) pre.textContent = text || "(no output yet)";
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  // ---- charts (SVG) -------------------------------------------------------------------------
  const H = 170;
  const M = { left: 46, right: 10, top: 10, bottom: 24 };

  function niceStep(range, ticks) {
    const raw = range / Math.max(1, ticks);
    const mag = 10 ** Math.floor(Math.log10(raw));
    for (const f of [1, 2, 2.5, 5, 10]) if (raw <= f * mag) return f * mag;
    return 10 * mag;
  }

  // The frame of a chart: axes, grid and tick labels; returns the scales.
  function frame(root, W, t0, t1, ymax, integer) {
    const x = (t) => M.left + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - M.left - M.right);
    const y = (v) => H - M.bottom - (v / ymax) * (H - M.top - M.bottom);
    let step = niceStep(ymax, 4);
    if (integer) step = Math.max(1, Math.round(step));
    for (let v = 0; v <= ymax + 1e-9; v += step) {
      root.append(svg("line", { class: "grid", x1: M.left, x2: W - M.right, y1: y(v), y2: y(v) }));
      root.append(svg("text", { class: "tick", x: M.left - 4, y: y(v) + 4, "text-anchor": "end" }, fmtNum(v)));
    }
    for (let i = 0; i <= 3; i += 1) {
      const t = t0 + ((t1 - t0) * i) / 3;
      const anchor = i === 0 ? "start" : i === 3 ? "end" : "middle";
      root.append(svg("text", { class: "tick", x: x(t), y: H - 6, "text-anchor": anchor }, fmtClock(t)));
    }
    root.append(svg("line", { class: "axis", x1: M.left, x2: W - M.right, y1: y(0), y2: y(0) }));
    return { x, y };
  }

  function figureFor(key, title, count, caption, W) {
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
    const figure = el("figure", { class: W > 440 ? "chart wide" : "chart", "data-chart": key, "data-points": String(count) }, el("figcaption", null, el("span", { text: title }), caption ? el("span", { class: "now", text: caption }) : null), root);
    return { figure, root };
  }

  function empty(root, W) {
    root.append(svg("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, "no samples yet"));
  }

  function lineChart({ key, title, step, points, span, colour: stroke }) {
    const W = 440;
    const last = points.length ? points[points.length - 1][1] : null;
    const { figure, root } = figureFor(key, title, points.length, last === null ? "" : `now ${fmtNum(last)}`, W);
    if (!points.length) {
      empty(root, W);
      return figure;
    }
    const t0 = span ? span[0] : points[0][0];
    const t1 = Math.max(span ? span[1] : points[points.length - 1][0], t0 + 1);
    const ymax = Math.max(...points.map((p) => p[1])) * 1.1 || 1;
    const { x, y } = frame(root, W, t0, t1, ymax, step);
    // a line is broken where the job posted nothing for a while (stopped, restarting):
    // a gap over 3 times the usual spacing, and over 5 s
    const gaps = points.slice(1).map((p, i) => p[0] - points[i][0]).sort((a, b) => a - b);
    const usual = gaps.length ? gaps[Math.floor(gaps.length / 2)] : 0;
    const broken = Math.max(5, 3 * usual);
    let d = `M${x(points[0][0]).toFixed(1)},${y(points[0][1]).toFixed(1)}`;
    points.slice(1).forEach(([t, v], i) => {
      const [px, py] = [x(t).toFixed(1), y(v).toFixed(1)];
      if (step) d += `H${px}V${py}`;
      else if (t - points[i][0] > broken) d += `M${px},${py}`;
      else d += `L${px},${py}`;
    });
    root.append(svg("path", { class: "line", d, stroke }));
    if (points.length === 1) root.append(svg("circle", { cx: x(points[0][0]), cy: y(points[0][1]), r: 3, fill: stroke }));
    return figure;
  }

  function stackChart({ key, title, caption, times, layers, total }) {
    const W = 900;
    const { figure, root } = figureFor(key, title, times.length, caption, W);
    if (!times.length) {
      empty(root, W);
      return figure;
    }
    const t0 = times[0];
    const t1 = Math.max(times[times.length - 1], t0 + 1);
    const top = times.map((_, i) => layers.reduce((s, l) => s + l.values[i], 0));
    const ymax = Math.max(total || 0, ...top, 1);
    const { x, y } = frame(root, W, t0, t1, ymax, true);
    const base = times.map(() => 0);
    // each layer a step area: the slots a job held from one round until the next
    const edges = times.map((t, i) => [x(t), i + 1 < times.length ? x(times[i + 1]) : x(t1)]);
    for (const layer of layers) {
      let upper = "";
      let lower = "";
      times.forEach((_, i) => {
        const [a, b] = edges[i];
        const hi = y(base[i] + layer.values[i]);
        upper += `${i ? "L" : "M"}${a.toFixed(1)},${hi.toFixed(1)}L${b.toFixed(1)},${hi.toFixed(1)}`;
      });
      for (let i = times.length - 1; i >= 0; i -= 1) {
        const [a, b] = edges[i];
        const lo = y(base[i]);
        lower += `L${b.toFixed(1)},${lo.toFixed(1)}L${a.toFixed(1)},${lo.toFixed(1)}`;
      }
      const area = svg("path", { class: "area", d: `${upper}${lower}Z`, fill: layer.colour });
      area.append(svg("title", {}, layer.name));
      root.append(area);
      layer.values.forEach((v, i) => {
        base[i] += v;
      });
    }
    if (total) root.append(svg("line", { class: "total", x1: M.left, x2: W - M.right, y1: y(total), y2: y(total) }));
    return figure;
  }

  // ---- start ------------------------------------------------------------------------------
  function start() {
    $("#login-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const token = $("#token").value.trim();
      if (!token) return;
      state.token = token;
      sessionStorage.setItem(TOKEN_KEY, token);
      $("#token").value = "";
      $("#login-error").textContent = "";
      navigate();
    });
    $("#logout").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      state.token = null;
      showLogin("");
    });
    window.addEventListener("hashchange", navigate);
    navigate();
  }

  start();
})();
