// pddgw web chat: the WebSocket Responses mode at /v1/responses of the host that served the page.
//
// One socket, kept open (reconnects when it drops).  Each turn sends response.create with the
// whole conversation as `input` messages, asking for what the page shows beyond the lean default
// (`return_token_ids`, `pddgw.states`); each response.output_text.delta becomes a span coloured
// by pddgw.role (prefill / rld / md) carrying data-position and data-token-ids; response.completed adds the
// answer to the history and shows its pddgw timeline; an error event ends the turn.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    log: $("log"), empty: $("empty"), form: $("form"), input: $("input"), send: $("send"),
    stop: $("stop"), newChat: $("new-chat"), dot: $("conn-dot"), connText: $("conn-text"),
    instructions: $("instructions"), maxTokens: $("max-tokens"), temperature: $("temperature"),
    pipeline: $("pipeline"), handoff: $("handoff"), apiKey: $("api-key"),
  };

  /** @type {{role: "user"|"assistant", content: string}[]} */
  let history = [];
  let ws = null;
  let everOpen = false;
  let retryMs = 500;
  let turnSeq = 0;
  let turn = null;   // the response in flight: {streamId, responseId, el, answer, text, userIndex, sentAt, ...}
  const abandoned = new Set();   // stream ids of turns left by "New chat" before their response.created

  // ---- connection -----------------------------------------------------------------------
  function wsUrl() {
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/responses";
  }

  function setConn(kind, text) {
    ui.dot.className = "dot " + kind;
    ui.connText.textContent = text;
    document.body.dataset.conn = kind;
    ui.send.disabled = kind !== "open" || turn !== null;
  }

  // A browser cannot set Authorization on a WebSocket: the key travels as the subprotocol
  // pddgw.key.<base64url(key)>, which the front door accepts (and echoes) instead.
  function keyProtocol(key) {
    let bin = "";
    for (const b of new TextEncoder().encode(key)) bin += String.fromCharCode(b);
    return "pddgw.key." + btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  }

  function connect() {
    setConn("connecting", "connecting…");
    const key = ui.apiKey.value.trim();
    const sock = key ? new WebSocket(wsUrl(), [keyProtocol(key)]) : new WebSocket(wsUrl());
    ws = sock;
    sock.onopen = () => {
      everOpen = true;
      retryMs = 500;
      setConn("open", "connected");
    };
    sock.onmessage = (msg) => {
      let ev;
      try {
        ev = JSON.parse(msg.data);
      } catch (e) {
        console.error("not JSON", msg.data);
        return;
      }
      onEvent(ev);
    };
    sock.onclose = (e) => {
      if (ws !== sock) return;
      ws = null;
      if (turn) failTurn(`connection closed (code ${e.code})`);
      // A refused upgrade (e.g. 401 when [server] api_keys is set) looks like 1006 before any open.
      const hint = everOpen ? "" : " — if the server sets [server] api_keys, enter a key in Settings";
      setConn("closed", `disconnected, retrying${hint}`);
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
  }

  ui.apiKey.value = sessionStorage.getItem("pddgw.apiKey") || "";
  ui.apiKey.addEventListener("change", () => {
    sessionStorage.setItem("pddgw.apiKey", ui.apiKey.value.trim());
    retryMs = 500;
    if (ws) ws.close(1000, "API key changed");      // onclose reconnects with the new key
    else connect();
  });

  // ---- rendering ------------------------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function nearBottom() {
    return ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80;
  }

  function scrollDown(force) {
    if (force || nearBottom()) ui.log.scrollTop = ui.log.scrollHeight;
  }

  function addMessage(role, text) {
    ui.empty.hidden = true;
    const m = el("div", "msg " + role);
    m.append(el("div", "who", role === "user" ? "you" : "assistant"));
    const body = el("div", role === "user" ? "bubble" : "bubble answer");
    if (text !== undefined) body.textContent = text;
    m.append(body);
    ui.log.append(m);
    scrollDown(true);
    return m;
  }

  function fmtMs(v) {
    if (v === null || v === undefined) return "–";
    return v < 10 ? `${v.toFixed(2)} ms` : v < 1000 ? `${v.toFixed(1)} ms` : `${(v / 1000).toFixed(2)} s`;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    let v = n;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return i === 0 ? `${n} B` : `${v.toFixed(v < 10 ? 2 : 1)} ${units[i]}`;
  }

  function chip(label, value, cls, title) {
    const c = el("span", "chip" + (cls ? " " + cls : ""));
    c.append(el("span", "k", label), el("span", "v", value));
    if (title) c.title = title;
    return c;
  }

  function renderTimeline(resp) {
    const tl = resp.pddgw || {};
    const usage = resp.usage || {};
    const byRole = tl.tokens_by_role || {};
    const shares = [["prefill", "P"], ["rld", "RLD"], ["md", "MD"]]
      .map(([role, label]) => [role, label, byRole[role] || 0]);
    const box = el("div", "timeline");
    box.dataset.pipeline = tl.pipeline || "";
    box.dataset.ttftMs = tl.ttft_ms ?? "";
    box.dataset.wanKvBytes = tl.wan_kv_bytes ?? "";
    box.dataset.handoffPosition = tl.handoff_position ?? "";

    const chips = el("div", "chips");
    const planned = tl.planned_pipeline && tl.planned_pipeline !== tl.pipeline
      ? ` (planned ${tl.planned_pipeline})` : "";
    chips.append(chip("pipeline", (tl.pipeline || "?") + planned, "pipe", tl.route_reason || ""));
    chips.append(chip("TTFT", fmtMs(tl.ttft_ms), "ttft"));
    chips.append(chip("total", fmtMs(tl.total_ms)));
    let handoff = "none";
    if (tl.handoff_position !== null && tl.handoff_position !== undefined) {
      const rounds = (tl.handoff_positions || []).length;
      handoff = `at token ${tl.handoff_position}` + (tl.handoff_mode ? `, ${tl.handoff_mode}` : "") +
        (rounds > 1 ? `, ${rounds} rounds` : "");
    }
    chips.append(chip("handoff", handoff, "handoff"));
    chips.append(chip("stall", fmtMs(tl.handoff_stall_ms), "stall"));
    chips.append(chip("WAN KV", fmtBytes(tl.wan_kv_bytes), "wan", `${tl.wan_kv_bytes ?? "?"} bytes`));
    if (usage.input_tokens !== undefined) {
      const cached = (usage.input_tokens_details || {}).cached_tokens || 0;
      chips.append(chip("prompt", `${usage.input_tokens} tok, ${cached} cached on MD`));
    }
    if ((tl.redrives || []).length) chips.append(chip("re-drives", String(tl.redrives.length), "warn"));
    if (tl.fallback_reason) chips.append(chip("fallback", tl.fallback_reason, "warn"));
    box.append(chips);

    // Who produced the answer: P's first token, RLD's share, then MD's, split at the handoff.
    if (shares.some(([, , n]) => n > 0)) {
      const bar = el("div", "split");
      bar.title = shares.map(([role, , n]) => `${role} ${n}`).join(" / ") + " tokens";
      for (const [role, label, n] of shares) {
        if (!n) continue;
        const s = el("span", "seg " + role, `${label} ${n}`);
        s.style.flexGrow = String(n);
        bar.append(s);
      }
      box.append(bar);
    }

    if ((tl.states || []).length) {
      const det = el("details", "states");
      det.append(el("summary", "", `states (${tl.final_state || "?"}, ${tl.states.length} steps)`));
      const ol = el("ol");
      for (const s of tl.states) {
        const li = el("li");
        li.append(el("span", "st", s.state), el("span", "t", fmtMs(s.t_ms)));
        if (s.reason) li.title = s.reason;
        ol.append(li);
      }
      det.append(ol);
      box.append(det);
    }
    return box;
  }

  // ---- turns ----------------------------------------------------------------------------
  function setBusy(busy) {
    ui.send.disabled = busy || !ws || ws.readyState !== WebSocket.OPEN;
    ui.stop.hidden = !busy;
  }

  function sendTurn() {
    const text = ui.input.value.trim();
    if (!text || turn || !ws || ws.readyState !== WebSocket.OPEN) return;
    ui.input.value = "";
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const m = addMessage("assistant");
    m.dataset.status = "streaming";
    const answer = m.querySelector(".answer");
    answer.append(el("span", "caret"));
    turnSeq += 1;
    turn = {
      streamId: `turn-${turnSeq}`, responseId: null, el: m, answer, text: "", lastRole: null,
      userIndex: history.length - 1, sentAt: performance.now(), firstAt: null,
    };
    const req = {
      type: "response.create",
      stream_id: turn.streamId,
      input: history.map((h) => ({ type: "message", role: h.role, content: h.content })),
      max_output_tokens: Math.max(1, parseInt(ui.maxTokens.value, 10) || 128),
      temperature: Math.min(2, Math.max(0, parseFloat(ui.temperature.value) || 0)),
      return_token_ids: true,     // each span's data-token-ids
    };
    const instructions = ui.instructions.value.trim();
    if (instructions) req.instructions = instructions;
    const ext = { states: true };  // the timeline's states panel
    if (ui.pipeline.value) ext.pipeline = ui.pipeline.value;
    if (ui.handoff.value) ext.handoff_mode = ui.handoff.value;
    req.pddgw = ext;
    ws.send(JSON.stringify(req));
    setBusy(true);
  }

  function appendToken(t, text, role, position, ids) {
    const span = el("span", "tok " + role, text);
    span.dataset.role = role;
    if (position !== null) span.dataset.position = String(position);
    span.dataset.tokenIds = ids.join(",");
    span.title = `${role.toUpperCase()} · position ${position}`;
    t.answer.insertBefore(span, t.answer.querySelector(".caret"));
    t.text += text;
    t.lastRole = role;
    return span;
  }

  function endTurn(t, status) {
    t.el.dataset.status = status;
    const caret = t.answer.querySelector(".caret");
    if (caret) caret.remove();
    turn = null;
    setBusy(false);
    ui.input.focus();
  }

  function failTurn(message) {
    const t = turn;
    if (!t) return;
    // The answer never arrived: the question stays on screen but leaves the history.
    history.splice(t.userIndex, 1);
    t.el.append(el("div", "error", message));
    endTurn(t, "error");
    scrollDown(true);
  }

  function onEvent(ev) {
    const t = turn;
    if (ev.type === "response.created" && abandoned.delete(ev.stream_id) && ws) {
      ws.send(JSON.stringify({ type: "response.cancel", response_id: ev.response.id }));
      return;
    }
    if (!t || (ev.stream_id !== undefined && ev.stream_id !== t.streamId)) {
      if (ev.type === "error") console.warn("error event outside a turn", ev);
      return;
    }
    switch (ev.type) {
      case "response.created":
        t.responseId = ev.response.id;
        t.el.dataset.responseId = ev.response.id;
        t.el.querySelector(".who").textContent = `assistant · ${ev.response.model}`;
        if (t.cancelWanted) cancelTurn();
        break;
      case "response.output_text.delta": {
        const p = ev.pddgw || {};
        if (t.firstAt === null) t.firstAt = performance.now();
        appendToken(t, ev.delta, p.role || "unknown", p.position ?? null, p.token_ids || []);
        scrollDown(false);
        break;
      }
      case "response.completed": {
        const resp = ev.response;
        const part = ((resp.output || [])[0] || { content: [] }).content[0] || {};
        const final = part.text ?? t.text;
        // The stream holds back a trailing partial character; the final text decodes it.
        if (final !== t.text && final.startsWith(t.text)) {
          appendToken(t, final.slice(t.text.length), t.lastRole || "md", null, []).classList.add("tail");
        }
        t.el.dataset.text = final;
        history.push({ role: "assistant", content: final });
        t.el.append(renderTimeline(resp));
        endTurn(t, "completed");
        scrollDown(true);
        break;
      }
      case "error": {
        const err = ev.error || {};
        failTurn(`${err.code || "error"}: ${err.message || "unknown error"}`);
        break;
      }
      default:
        break;
    }
  }

  // ---- controls -------------------------------------------------------------------------
  ui.form.addEventListener("submit", (e) => {
    e.preventDefault();
    sendTurn();
  });
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      sendTurn();
    }
  });
  function cancelTurn() {
    if (!turn) return;
    turn.cancelWanted = true;   // before response.created: sent when its id arrives
    if (turn.responseId && ws && ws.readyState === WebSocket.OPEN) {
      ws.send(JSON.stringify({ type: "response.cancel", response_id: turn.responseId }));
    }
  }

  ui.stop.addEventListener("click", cancelTurn);
  ui.newChat.addEventListener("click", () => {
    cancelTurn();
    if (turn && !turn.responseId) abandoned.add(turn.streamId);
    turn = null;
    history = [];
    for (const m of [...ui.log.querySelectorAll(".msg")]) m.remove();
    ui.empty.hidden = false;
    setBusy(false);
    ui.input.focus();
  });

  connect();
  ui.input.focus();
})();
