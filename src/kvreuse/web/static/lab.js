// kvreuse lab: controls -> POST /api/run (the Python simulator) -> an animated replay.
// Plain JS, no build step, no network beyond this server. The page only draws: every number
// shown comes from the simulator's answer.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const STAR_KEY = "kvreuse-lab-stars";
  const MAX_BARS_PER_LANE = 24;
  const TREE_KINDS = { system: "system prompt", user: "user turn", answer: "answer", other: "other" };

  const state = {
    config: null,
    result: null,
    mission: null, // mission object while one is active
    // wall seconds to replay the whole simulated run (a test may set window.kvLabOptions first)
    animSeconds: (window.kvLabOptions && window.kvLabOptions.animationSeconds) || 6,
    anim: null, // {startWall, raf}
    lanes: [], // per replica: {indices, els}
    barScale: 1,
    treeDrawn: false,
    runSeq: 0,
  };

  const $ = (id) => document.getElementById(id);
  const svg = (tag, attrs, parent) => {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    if (parent) parent.appendChild(el);
    return el;
  };

  // ------------------------------------------------------------------ formatting

  const pct = (x) => (100 * x).toFixed(1) + " %";
  const compact = (n) => {
    if (n >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return String(Math.round(n));
  };
  const TILE_FORMAT = {
    token_hit_rate: pct,
    request_hit_rate: pct,
    prefill_gpu_s_per_1k: (x) => x.toFixed(1),
    ttft_p95_s: (x) => x.toFixed(3) + " s",
    evicted_tokens: compact,
    replicas: (x) => String(x),
  };
  const gib = (tokens) => (tokens * 128 * 1024) / 2 ** 30;

  // ------------------------------------------------------------------ stars

  function loadStars() {
    try {
      return JSON.parse(localStorage.getItem(STAR_KEY) || "{}") || {};
    } catch (e) {
      return {};
    }
  }
  function saveStar(id) {
    const stars = loadStars();
    stars[id] = true;
    localStorage.setItem(STAR_KEY, JSON.stringify(stars));
  }

  // ------------------------------------------------------------------ controls

  const CONTROL_NAMES = [
    "scenario", "cache_enabled", "cache_tokens", "replicas", "routing",
    "spill_threshold_s", "scheduling", "arrival_rate", "seed", "duration_s", "timestamp_at",
  ];
  const NUMERIC = new Set(["cache_tokens", "replicas", "spill_threshold_s", "arrival_rate", "seed", "duration_s", "timestamp_at"]);
  const INTEGER = new Set(["cache_tokens", "replicas", "seed", "timestamp_at"]);

  function fillSelect(el, names, descriptions) {
    el.innerHTML = "";
    for (const name of names) {
      const opt = document.createElement("option");
      opt.value = name;
      opt.textContent = name.replace(/_/g, " ");
      if (descriptions && descriptions[name]) opt.title = descriptions[name];
      el.appendChild(opt);
    }
  }

  function readControls() {
    const out = {};
    for (const name of CONTROL_NAMES) {
      const el = $("ctl-" + name);
      if (el.type === "checkbox") out[name] = el.checked;
      else if (NUMERIC.has(name)) out[name] = INTEGER.has(name) ? parseInt(el.value, 10) : parseFloat(el.value);
      else out[name] = el.value;
    }
    if (!$("ts-on").checked) out.timestamp_at = null;
    if (state.mission) out.mission = state.mission.id;
    return out;
  }

  function writeControls(values) {
    for (const [name, value] of Object.entries(values)) {
      const el = $("ctl-" + name);
      if (!el) continue;
      if (name === "timestamp_at") {
        $("ts-on").checked = value !== null && value !== undefined && value !== "none" && value !== "null";
        if (!$("ts-on").checked) continue;
      }
      if (el.type === "checkbox") el.checked = !!value;
      else {
        if (el.type === "range") {
          // let out-of-slider values (a mission preset, a link) through instead of clamping
          if (Number(value) > Number(el.max)) el.max = String(value);
          if (Number(value) < Number(el.min)) el.min = String(value);
        }
        el.value = String(value);
      }
    }
    showOutputs();
  }

  function showOutputs() {
    const v = readControls();
    $("out-cache_tokens").textContent = v.cache_tokens.toLocaleString("en-US") + " tokens · " + gib(v.cache_tokens).toFixed(2) + " GiB";
    $("out-replicas").textContent = String(v.replicas);
    $("out-spill_threshold_s").textContent = Math.round(v.spill_threshold_s * 1000) + " ms";
    $("out-arrival_rate").textContent = v.arrival_rate + " req/s";
    $("ctl-timestamp_at").disabled = v.timestamp_at === null;
    $("out-timestamp_at").textContent = v.timestamp_at === null ? "none" : String(v.timestamp_at);
  }

  function showError(message, field) {
    const box = $("error");
    document.querySelectorAll(".invalid").forEach((el) => el.classList.remove("invalid"));
    if (!message) {
      box.hidden = true;
      box.textContent = "";
      return;
    }
    box.hidden = false;
    box.textContent = message; // the server's message already names the field
    const el = field && $("ctl-" + field);
    if (el) el.classList.add("invalid");
  }

  // ------------------------------------------------------------------ missions

  function buildMissions() {
    const host = $("missions");
    host.innerHTML = "";
    const stars = loadStars();
    for (const m of state.config.missions) {
      const card = document.createElement("button");
      card.type = "button";
      card.className = "mission";
      card.dataset.mission = m.id;
      const star = document.createElement("span");
      star.className = "star" + (stars[m.id] ? "" : " off");
      star.textContent = stars[m.id] ? "★" : "☆";
      star.title = stars[m.id] ? "goal met" : "goal not met yet";
      const title = document.createElement("span");
      title.className = "title";
      title.textContent = m.title;
      const goal = document.createElement("span");
      goal.className = "goal";
      goal.textContent = m.goal;
      card.append(star, title, goal);
      card.addEventListener("click", () => startMission(m.id, false));
      host.appendChild(card);
      if (state.mission && state.mission.id === m.id) card.classList.add("active");
    }
  }

  function startMission(id, keepControls) {
    const m = state.config.missions.find((x) => x.id === id);
    state.mission = m;
    if (!keepControls) writeControls(Object.assign({}, state.config.defaults, m.preset));
    $("mission-panel").hidden = false;
    $("mission-panel").classList.remove("won");
    $("mission-title").textContent = m.title;
    $("mission-story").textContent = m.story;
    $("mission-goal").textContent = m.goal;
    $("mission-hint").textContent = "Hint: " + m.hint;
    const list = $("mission-conditions");
    list.innerHTML = "";
    for (const c of m.conditions) {
      const li = document.createElement("li");
      li.textContent = c.label;
      list.appendChild(li);
    }
    buildMissions();
    run();
  }

  function leaveMission() {
    state.mission = null;
    $("mission-panel").hidden = true;
    buildMissions();
  }

  function showGoal(goal) {
    if (!goal || !state.mission || goal.mission !== state.mission.id) return;
    const list = $("mission-conditions");
    list.innerHTML = "";
    for (const c of goal.conditions) {
      const li = document.createElement("li");
      li.className = c.met ? "met" : "unmet";
      li.textContent = c.label;
      const actual = document.createElement("span");
      actual.className = "actual";
      actual.textContent = "(now " + c.display + ")";
      li.appendChild(actual);
      list.appendChild(li);
    }
    $("mission-panel").classList.toggle("won", goal.met);
    if (goal.met) {
      saveStar(goal.mission);
      buildMissions();
    }
  }

  // ------------------------------------------------------------------ running

  async function run() {
    const seq = ++state.runSeq;
    const asked = performance.now();
    showError(null);
    $("status").textContent = "simulating…";
    document.body.dataset.state = "running";
    let response, body;
    try {
      response = await fetch("/api/run", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(readControls()),
      });
      body = await response.json();
    } catch (e) {
      if (seq !== state.runSeq) return;
      showError("the lab server did not answer: " + e, null);
      document.body.dataset.state = "error";
      return;
    }
    if (seq !== state.runSeq) return; // a newer run superseded this one
    if (!response.ok) {
      showError(body.error, body.field);
      $("status").textContent = "";
      document.body.dataset.state = "error";
      return;
    }
    state.result = body;
    $("status").textContent =
      body.requests.arrival_s.length + " requests simulated in " + (1000 * body.sim_wall_s).toFixed(0) + " ms";
    showGoal(body.goal);
    prepare(body);
    animate();
    // from the click to the first frame's data drawn: what benchmarks/lab_speed.py reads
    document.body.dataset.readyMs = (performance.now() - asked).toFixed(1);
  }

  // ------------------------------------------------------------------ drawing: bars

  function prepare(result) {
    const n = result.replica_ids.length;
    const req = result.requests;
    const lanes = [];
    for (let i = 0; i < n; i++) lanes.push({ indices: [], cached: 0, prompt: 0 });
    for (let k = 0; k < req.arrival_s.length; k++) lanes[req.replica[k]].indices.push(k);
    // running totals per lane, so the label shows the lane's hit rate up to the replay's time
    for (const lane of lanes) {
      lane.cumCached = [0];
      lane.cumPrompt = [0];
      for (const k of lane.indices) {
        lane.cumCached.push(lane.cumCached[lane.cumCached.length - 1] + req.cached_tokens[k]);
        lane.cumPrompt.push(lane.cumPrompt[lane.cumPrompt.length - 1] + req.prompt_tokens[k]);
      }
    }
    // scale bars to the 98th percentile prompt so one outlier does not flatten the rest
    const sorted = req.prompt_tokens.slice().sort((a, b) => a - b);
    state.barScale = sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(0.98 * sorted.length))] : 1;

    const host = $("bars");
    host.innerHTML = "";
    const width = host.clientWidth || 600;
    const height = host.clientHeight || 520;
    host.setAttribute("viewBox", "0 0 " + width + " " + height);
    const laneH = height / n;
    const labelW = 118;
    // as many bars as the lane holds at 7 px (thinner when lanes are short), newest on top
    const barH = Math.max(1.5, Math.min(7, (laneH - 8) / 3 - 1));
    const barsPerLane = Math.max(1, Math.min(MAX_BARS_PER_LANE, Math.floor((laneH - 6) / (barH + 1))));
    lanes.forEach((lane, i) => {
      const g = svg("g", { class: "lane", "data-replica": String(i), transform: "translate(0," + i * laneH + ")" }, host);
      if (i > 0) svg("line", { class: "lane-sep", x1: 0, x2: width, y1: 0, y2: 0 }, g);
      // short lanes (many replicas) put the label and its hit rate on one line
      const compactLane = laneH < 40;
      const label = svg("text", { class: "lane-label", x: 4, y: compactLane ? laneH / 2 + 4 : 16 }, g);
      label.textContent = (compactLane ? "r" : "replica ") + (i + 1);
      const stat = compactLane
        ? svg("text", { class: "lane-stat", x: 34, y: laneH / 2 + 4 }, g)
        : svg("text", { class: "lane-stat", x: 4, y: 30 }, g);
      lane.stat = stat;
      lane.compact = compactLane;
      lane.bars = [];
      for (let b = 0; b < barsPerLane; b++) {
        const y = 4 + b * (barH + 1);
        if (y + barH > laneH) break;
        const frame = svg("rect", { class: "bar-frame", x: labelW, y: y, height: barH, width: 0 }, g);
        const cached = svg("rect", { class: "bar-cached", x: labelW, y: y, height: barH, width: 0 }, g);
        const prefilled = svg("rect", { class: "bar-prefilled", x: labelW, y: y, height: barH, width: 0 }, g);
        lane.bars.push({ frame, cached, prefilled });
      }
      lane.x0 = labelW;
      lane.w = width - labelW - 6;
    });
    state.lanes = lanes;
    state.treeDrawn = false;
    drawTreeWaiting(result);
  }

  // number of entries of the sorted array `xs` (indexed through `idx`) that are <= t
  function countUpTo(idx, xs, t) {
    let lo = 0, hi = idx.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (xs[idx[mid]] <= t) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  function drawBars(t) {
    const req = state.result.requests;
    for (const lane of state.lanes) {
      const seen = countUpTo(lane.indices, req.arrival_s, t);
      lane.bars.forEach((bar, b) => {
        const pos = seen - 1 - b; // newest first
        if (pos < 0) {
          bar.frame.setAttribute("width", 0);
          bar.cached.setAttribute("width", 0);
          bar.prefilled.setAttribute("width", 0);
          return;
        }
        const k = lane.indices[pos];
        const scale = lane.w / state.barScale;
        const prompt = Math.min(req.prompt_tokens[k], state.barScale * 1.02);
        const cached = Math.min(req.cached_tokens[k], prompt);
        const prefilledFull = prompt - cached;
        const ttft = req.ttft_s[k];
        const done = ttft > 0 ? Math.min(1, (t - req.arrival_s[k]) / ttft) : 1;
        bar.frame.setAttribute("width", prompt * scale);
        bar.cached.setAttribute("width", cached * scale);
        bar.prefilled.setAttribute("x", lane.x0 + cached * scale);
        bar.prefilled.setAttribute("width", Math.max(0, prefilledFull * done * scale));
      });
      const promptSum = lane.cumPrompt[seen];
      const hit = promptSum ? Math.round((100 * lane.cumCached[seen]) / promptSum) + "%" : "";
      lane.stat.textContent = lane.compact
        ? seen + " req " + hit
        : seen + " req" + (hit ? " · " + hit + " cached" : "");
    }
  }

  // ------------------------------------------------------------------ drawing: tree

  function drawTreeWaiting(result) {
    const host = $("tree");
    host.innerHTML = "";
    const width = host.clientWidth || 500;
    const height = host.clientHeight || 480;
    host.setAttribute("viewBox", "0 0 " + width + " " + height);
    const tree = result.tree;
    $("tree-title").textContent = tree
      ? "Radix tree of replica 1 at t = " + tree.at_s.toFixed(0) + " s (halfway)"
      : "Radix tree of replica 1";
    const text = svg("text", { class: "tree-wait", x: 12, y: 24 }, host);
    text.textContent = tree ? "the tree appears when the replay reaches t = " + tree.at_s.toFixed(0) + " s" : "no tree: the cache is off";
    $("tree-note").textContent = "";
  }

  function drawTree(tree) {
    const host = $("tree");
    host.innerHTML = "";
    const width = host.clientWidth || 500;
    const height = host.clientHeight || 480;
    host.setAttribute("viewBox", "0 0 " + width + " " + height);
    const nodes = tree.nodes;
    const byId = new Map();
    const roots = [];
    for (const n of nodes) byId.set(n.id, Object.assign({ children: [] }, n));
    for (const n of byId.values()) {
      if (n.parent === null || !byId.has(n.parent)) roots.push(n);
      else byId.get(n.parent).children.push(n);
    }
    // bigger subtrees first so the trunk of the busiest prefix stays on top
    const weight = (n) => (n.w !== undefined ? n.w : (n.w = n.tokens + n.children.reduce((s, c) => s + weight(c), 0)));
    const order = (list) => list.sort((a, b) => weight(b) - weight(a)).forEach((n) => order(n.children));
    order(roots);
    // layout: x by token depth (where the edge starts and ends), y by leaf order
    let maxEnd = 1, maxTokens = 1, leaves = 0;
    const visit = (n) => {
      maxEnd = Math.max(maxEnd, n.start + n.tokens);
      maxTokens = Math.max(maxTokens, n.tokens);
      if (!n.children.length) n.leaf = leaves++;
      n.children.forEach(visit);
    };
    roots.forEach(visit);
    const pad = 14, rootX = pad;
    const x = (tok) => rootX + 8 + ((width - 2 * pad - 16) * tok) / maxEnd;
    const rowH = (height - 2 * pad) / Math.max(leaves, 1);
    const place = (n) => {
      n.children.forEach(place);
      n.y = n.children.length ? n.children.reduce((s, c) => s + c.y, 0) / n.children.length : pad + (n.leaf + 0.5) * rowH;
      n.x = x(n.start + n.tokens / 2);
    };
    roots.forEach(place);
    const rootY = roots.length ? roots.reduce((s, r) => s + r.y, 0) / roots.length : height / 2;
    const rMax = Math.max(4, Math.min(22, rowH * 1.6, height / 12));
    const radius = (tokens) => Math.max(1.6, rMax * Math.sqrt(tokens / maxTokens));
    const edges = svg("g", {}, host);
    const circles = svg("g", {}, host);
    const link = (x1, y1, x2, y2) => {
      const mx = (x1 + x2) / 2;
      svg("path", { class: "tree-edge", d: "M" + x1 + "," + y1 + " C" + mx + "," + y1 + " " + mx + "," + y2 + " " + x2 + "," + y2 }, edges);
    };
    const drawNode = (n, px, py) => {
      link(px, py, n.x, n.y);
      const c = svg("circle", {
        class: "tree-node " + (TREE_KINDS[n.kind] ? n.kind : "other") + (n.locked ? " locked" : ""),
        cx: n.x, cy: n.y, r: radius(n.tokens), "data-kind": n.kind, "data-tokens": n.tokens,
      }, circles);
      const title = svg("title", {}, c);
      title.textContent = (TREE_KINDS[n.kind] || n.kind) + " · " + n.tokens + " tokens from token " + n.start + (n.locked ? " · pinned by a running request" : "");
      n.children.forEach((ch) => drawNode(ch, n.x, n.y));
    };
    roots.forEach((r) => drawNode(r, rootX, rootY));
    svg("circle", { class: "tree-root", cx: rootX, cy: rootY, r: 4 }, circles);
    const shown = nodes.reduce((s, n) => s + n.tokens, 0);
    $("tree-note").textContent =
      nodes.length + " nodes, " + compact(tree.total_tokens) + " tokens cached" +
      (tree.omitted_nodes ? " (" + tree.omitted_nodes + " small nodes not drawn, " + compact(tree.total_tokens - shown) + " tokens)" : "") +
      ". Circle area ∝ tokens; colour = the kind of most of its tokens; x = position in the prompt; " +
      "outlined = pinned by a running request.";
  }

  function buildTreeLegend() {
    const host = $("tree-legend");
    host.innerHTML = "";
    for (const [kind, label] of Object.entries(TREE_KINDS)) {
      const item = document.createElement("span");
      const sw = document.createElement("i");
      sw.className = "sw round";
      sw.style.background = "var(--" + kind + ")";
      item.append(sw, document.createTextNode(label));
      host.appendChild(item);
    }
  }

  // ------------------------------------------------------------------ drawing: tiles and time

  function tilesAt(t) {
    const tl = state.result.timeline;
    let best = null;
    for (const p of tl) {
      if (p.t_s <= t) best = p;
      else break;
    }
    return best;
  }

  function drawTiles(values) {
    for (const el of document.querySelectorAll(".tile")) {
      const key = el.dataset.tile;
      const v = values ? values[key] : undefined;
      el.querySelector(".v").textContent = v === undefined || v === null ? "–" : TILE_FORMAT[key](v);
    }
  }

  function frame(wallNow) {
    const result = state.result;
    const duration = result.controls.duration_s;
    const progress = state.animSeconds > 0 ? Math.min(1, (wallNow - state.anim.startWall) / (1000 * state.animSeconds)) : 1;
    const t = progress * duration;
    drawBars(t);
    drawTiles(progress >= 1 ? result.tiles : tilesAt(t) || { replicas: result.tiles.replicas });
    if (!state.treeDrawn && result.tree && t >= result.tree.at_s) {
      drawTree(result.tree);
      state.treeDrawn = true;
    }
    $("clock").textContent = "t = " + t.toFixed(1) + " s of " + duration.toFixed(0) + " s";
    $("progress").value = progress;
    if (progress < 1) {
      state.anim.raf = requestAnimationFrame(frame);
    } else {
      state.anim = null;
      $("skip").disabled = true;
      document.body.dataset.state = "done";
      document.body.dataset.runs = String(Number(document.body.dataset.runs || 0) + 1);
    }
  }

  function animate() {
    if (state.anim) cancelAnimationFrame(state.anim.raf);
    state.anim = { startWall: performance.now(), raf: 0 };
    document.body.dataset.state = "animating";
    $("replay").disabled = false;
    $("skip").disabled = false;
    state.anim.raf = requestAnimationFrame(frame);
  }

  function skip() {
    if (!state.anim) return;
    state.anim.startWall = -1e12;
  }

  // ------------------------------------------------------------------ start-up

  function applyQuery() {
    const params = new URLSearchParams(location.search);
    const values = {};
    for (const name of CONTROL_NAMES) {
      if (params.has(name)) {
        const text = params.get(name);
        values[name] = name === "cache_enabled" ? text === "true" || text === "1" : text;
      }
    }
    writeControls(values);
    const mission = params.get("mission");
    if (mission && state.config.missions.some((m) => m.id === mission)) {
      state.mission = state.config.missions.find((m) => m.id === mission);
    }
  }

  async function init() {
    const response = await fetch("/api/config");
    state.config = await response.json();
    const cfg = state.config;
    fillSelect($("ctl-scenario"), cfg.choices.scenario, cfg.descriptions.scenario);
    fillSelect($("ctl-routing"), cfg.choices.routing, cfg.descriptions.routing);
    fillSelect($("ctl-scheduling"), cfg.choices.scheduling, cfg.descriptions.scheduling);
    writeControls(cfg.defaults);
    applyQuery();
    buildMissions();
    buildTreeLegend();
    for (const name of CONTROL_NAMES) $("ctl-" + name).addEventListener("input", showOutputs);
    $("ts-on").addEventListener("input", showOutputs);
    if (state.mission) startMission(state.mission.id, true);
    $("controls").addEventListener("submit", (e) => {
      e.preventDefault();
      run();
    });
    $("replay").addEventListener("click", () => state.result && (prepare(state.result), animate()));
    $("skip").addEventListener("click", skip);
    $("mission-leave").addEventListener("click", leaveMission);
    if (!state.mission) run();
  }

  // a hook for tests and for people who want the replay faster or slower
  window.kvLab = {
    setAnimationSeconds: (s) => { state.animSeconds = s; },
    state: () => state,
  };

  init().catch((e) => {
    showError("could not load the lab's configuration: " + e, null);
    document.body.dataset.state = "error";
  });
})();
