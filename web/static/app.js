// The tokenrelay chat page: one WebSocket to /v1/ws (protocol: docs/websocket.md).
// Vanilla JS, no build step. The page keeps the conversation itself and sends the whole
// history with every request, as a chat-completions client does.
//
// Resuming: the answer in flight survives a dropped socket and a page reload. The page
// keeps, in sessionStorage (per tab, so a reload keeps it), the conversation shown so far
// and, for the answer in flight, its request id (from the server's `started` message),
// the text so far and the cursor of the last event it applied, both written in one
// setItem so they always agree. When the socket comes back (reconnecting with backoff)
// it sends `resume` with that cursor and the server sends exactly the events after it;
// an event at or before the cursor is ignored, so no text is ever applied twice.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const ui = {
    connection: $("connection"),
    messages: $("messages"),
    error: $("error"),
    composer: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
    system: $("system"),
    apiKey: $("api-key"),
    newChat: $("new-chat"),
  };

  // sessionStorage keys: the finished conversation, and the answer in flight.
  const CHAT_KEY = "tokenrelay.chat";
  const FLIGHT_KEY = "tokenrelay.inflight";
  // Reconnect backoff: quick at first (a resumable answer waits on the server only for
  // the resume grace, 10 s by default), then slower, with jitter so that many tabs do
  // not come back in lockstep after a server restart.
  const RETRY_FIRST_MS = 250;
  const RETRY_MAX_MS = 8000;

  let history = []; // {role, content} turns sent with every request
  let shown = []; // finished turns on screen: {role, text, state, finish, label}
  let socket = null;
  let retryMs = RETRY_FIRST_MS;
  let retryTimer = null;
  let nextId = 1;
  // The answer in flight: {id, requestId, cursor, text, userTurn, failed, ended, finish,
  // label, stopRequested} plus its DOM element `turn` (not stored).
  let current = null;

  // -- storage ----------------------------------------------------------------------------
  function load(key) {
    try {
      const raw = sessionStorage.getItem(key);
      return raw ? JSON.parse(raw) : null;
    } catch {
      return null; // storage disabled or a corrupt entry: start afresh
    }
  }

  function store(key, value) {
    try {
      if (value === null) sessionStorage.removeItem(key);
      else sessionStorage.setItem(key, JSON.stringify(value));
    } catch {
      // Quota or privacy mode: the page still works, it just cannot survive a reload.
    }
  }

  function saveChat() {
    store(CHAT_KEY, { history, shown, nextId });
  }

  function saveFlight() {
    if (!current) {
      store(FLIGHT_KEY, null);
      return;
    }
    const { turn, ...rest } = current;
    store(FLIGHT_KEY, rest);
  }

  // -- cursors ----------------------------------------------------------------------------
  // A cursor is "<output chunk ordinal>/<index>", e.g. "17/1"; they only grow along one
  // request's output.
  function cursorParts(cursor) {
    const m = /^(\d+)\/(\d+)$/.exec(cursor || "");
    return m ? [Number(m[1]), Number(m[2])] : null;
  }

  function isNewer(cursor, last) {
    const a = cursorParts(cursor);
    const b = cursorParts(last);
    if (!a || !b) return true;
    for (let i = 0; i < 2; i++) {
      if (a[i] !== b[i]) return a[i] > b[i];
    }
    return false;
  }

  // -- connection -------------------------------------------------------------------------
  function socketUrl() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const key = ui.apiKey.value.trim();
    // Browsers cannot set an Authorization header on a WebSocket, hence the query string.
    const query = key ? `?api_key=${encodeURIComponent(key)}` : "";
    return `${scheme}//${location.host}/v1/ws${query}`;
  }

  function setConnection(state, text) {
    ui.connection.dataset.state = state;
    ui.connection.textContent = text;
    updateButtons();
  }

  function connect() {
    clearTimeout(retryTimer);
    retryTimer = null;
    setConnection("connecting", current ? "reconnecting…" : "connecting…");
    const ws = new WebSocket(socketUrl());
    socket = ws;
    ws.onopen = () => {
      if (socket !== ws) return;
      retryMs = RETRY_FIRST_MS;
      setConnection("open", "connected");
      if (current) resumeCurrent();
    };
    ws.onmessage = (ev) => {
      if (socket !== ws) return;
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      onServerMessage(msg);
    };
    ws.onclose = (ev) => {
      if (socket !== ws) return;
      socket = null;
      if (ev.code === 1008) {
        failCurrent({ message: "Not authorized: check the API key." });
        setConnection("closed", "not authorized");
        return; // reconnect when the API key changes
      }
      if (current && !current.requestId && !current.ended) {
        // The server never said which request it started: there is nothing to resume.
        failCurrent({ message: "The connection was lost before the request started." });
      }
      setConnection("closed", current ? "connection lost, resuming…" : "disconnected, retrying…");
      scheduleReconnect();
    };
  }

  function scheduleReconnect() {
    const delay = retryMs / 2 + Math.random() * (retryMs / 2);
    retryMs = Math.min(retryMs * 2, RETRY_MAX_MS);
    clearTimeout(retryTimer);
    retryTimer = setTimeout(connect, delay);
  }

  function reconnect() {
    const old = socket;
    socket = null;
    if (old) old.close();
    connect();
  }

  function send(message) {
    if (!socket || socket.readyState !== WebSocket.OPEN) return false;
    socket.send(JSON.stringify(message));
    return true;
  }

  // Continue the answer in flight on a fresh socket.
  function resumeCurrent() {
    if (current.ended) {
      // Its last event arrived before the socket dropped; only `done` was missing.
      finishCurrent(current.failed ? "error" : current.finish === "abort" ? "aborted" : "done");
      return;
    }
    if (!current.requestId) {
      failCurrent({ message: "The connection was lost before the request started." });
      return;
    }
    send({ type: "resume", id: current.id, request_id: current.requestId, cursor: current.cursor });
    if (current.stopRequested) send({ type: "cancel", id: current.id });
  }

  // -- rendering --------------------------------------------------------------------------
  function addTurn(role, text) {
    const empty = ui.messages.querySelector(".empty");
    if (empty) empty.remove();
    const el = document.createElement("article");
    el.className = `message ${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role === "user" ? "You" : "Assistant";
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text; // textContent: model output is never parsed as HTML
    const meta = document.createElement("div");
    meta.className = "finish";
    el.append(who, content, meta);
    ui.messages.append(el);
    scrollDown();
    return el;
  }

  function showTurn(turn) {
    const el = addTurn(turn.role, turn.text);
    if (turn.state) el.dataset.state = turn.state;
    if (turn.finish) el.dataset.finish = turn.finish;
    el.querySelector(".finish").textContent = turn.label || "";
    return el;
  }

  // The model's reasoning and its tool calls are shown apart from its answer, above it.
  function extraBlock(turn, cls, label) {
    let el = turn.querySelector(`.${cls}`);
    if (!el) {
      el = document.createElement("div");
      el.className = cls;
      el.dataset.label = label;
      turn.insertBefore(el, turn.querySelector(".content"));
    }
    return el;
  }

  function showExtras(req, msg) {
    if (msg.reasoning) {
      const el = extraBlock(req.turn, "reasoning", "Thinking");
      el.textContent += msg.reasoning; // textContent: never parsed as HTML
    }
    for (const call of msg.tool_calls || []) {
      // Fragments as OpenAI streams them: name first, then argument pieces, by index.
      req.calls = req.calls || [];
      const c = (req.calls[call.index] = req.calls[call.index] || { name: "", args: "" });
      if (call.function && call.function.name) c.name = call.function.name;
      c.args += (call.function && call.function.arguments) || "";
      const el = extraBlock(req.turn, "tool-calls", "Tool calls");
      el.textContent = req.calls.filter(Boolean).map((x) => `${x.name}(${x.args})`).join("\n");
    }
  }

  function scrollDown() {
    ui.messages.scrollTop = ui.messages.scrollHeight;
  }

  function showError(error) {
    const message = (error && error.message) || "Request failed.";
    // Name the offending field unless the message already does.
    const param = error && error.param && !message.includes(error.param) ? ` (${error.param})` : "";
    ui.error.textContent = `${message}${param}`;
    ui.error.hidden = false;
  }

  function clearError() {
    ui.error.hidden = true;
    ui.error.textContent = "";
  }

  function updateButtons() {
    const open = socket !== null && socket.readyState === WebSocket.OPEN;
    ui.send.disabled = !open || current !== null;
    ui.stop.disabled = current === null;
  }

  function setLabel(text) {
    current.label = text;
    current.turn.querySelector(".finish").textContent = text;
  }

  const FINISH_LABELS = {
    stop: "",
    length: "stopped: max tokens reached",
    abort: "stopped",
    error: "error",
    tool_calls: "called tools",
  };

  // -- requests ---------------------------------------------------------------------------
  function numberOrUndefined(input, parse) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const value = parse(raw);
    // Out-of-range values are sent as they are: the server validates and says why.
    return Number.isNaN(value) ? raw : value;
  }

  function startRequest(text) {
    clearError();
    const userTurn = { role: "user", content: text };
    history.push(userTurn);
    shown.push({ role: "user", text });
    addTurn("user", text);
    const id = `c${nextId++}`;
    const turn = addTurn("assistant", "");
    turn.dataset.state = "streaming";
    current = {
      id,
      turn,
      requestId: null,
      cursor: null,
      text: "",
      userTurn,
      failed: false,
      ended: false,
      finish: null,
      label: "",
      stopRequested: false,
    };
    saveChat();
    saveFlight();

    const messages = [];
    const system = ui.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history);
    const body = { type: "chat", id, messages };
    const temperature = numberOrUndefined(ui.temperature, Number);
    const maxTokens = numberOrUndefined(ui.maxTokens, Number);
    if (temperature !== undefined) body.temperature = temperature;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    if (!send(body)) failCurrent({ message: "Not connected to the server." });
    updateButtons();
  }

  function failCurrent(error) {
    if (!current) return;
    current.failed = true;
    showError(error);
    finishCurrent("error");
  }

  function finishCurrent(state) {
    const req = current;
    if (!req) return;
    current = null;
    req.turn.dataset.state = state;
    const meta = req.turn.querySelector(".finish");
    if (state === "error" && !meta.textContent) meta.textContent = "failed";
    if (req.text) {
      history.push({ role: "assistant", content: req.text });
    } else {
      // Nothing came back: drop the turn so the next request is not a dangling question.
      const i = history.findIndex(
        (t) => t.role === req.userTurn.role && t.content === req.userTurn.content,
      );
      if (i >= 0 && req.failed && i === history.length - 1) history.splice(i, 1);
    }
    shown.push({
      role: "assistant",
      text: req.text,
      state,
      finish: req.turn.dataset.finish || null,
      label: meta.textContent,
    });
    saveChat();
    saveFlight();
    updateButtons();
    if (socket && socket.readyState === WebSocket.OPEN) {
      setConnection("open", "connected");
    }
    ui.prompt.focus();
  }

  function onServerMessage(msg) {
    const mine = current && msg.id === current.id;
    if (mine && msg.cursor && msg.type !== "error") {
      // Already applied before the socket dropped (or the page reloaded): skip it.
      if (!isNewer(msg.cursor, current.cursor)) return;
      current.cursor = msg.cursor;
    }
    switch (msg.type) {
      case "started":
        if (mine) {
          current.requestId = msg.request_id;
          saveFlight();
        }
        break;
      case "delta":
        if (mine) {
          if (msg.choice === 0 && msg.text) {
            current.text += msg.text;
            current.turn.querySelector(".content").textContent = current.text;
            scrollDown();
          }
          if (msg.choice === 0 && (msg.reasoning || msg.tool_calls)) {
            showExtras(current, msg);
            scrollDown();
          }
          saveFlight(); // text and cursor in one write: a reload never sees them disagree
        }
        break;
      case "final":
        if (mine) {
          if (msg.choice === 0) {
            const reason = msg.finish_reason || "stop";
            current.finish = reason;
            current.turn.dataset.finish = reason;
            setLabel(FINISH_LABELS[reason] ?? reason);
            if (reason === "error" && msg.error) showError(msg.error);
          }
          saveFlight();
        }
        break;
      case "usage":
        if (mine) {
          current.ended = true; // the last event of a request; only `done` follows
          if (msg.usage) {
            const tokens = `${msg.usage.completion_tokens} tokens`;
            setLabel(current.label ? `${current.label} · ${tokens}` : tokens);
          }
          saveFlight();
        }
        break;
      case "error":
        if (mine) {
          current.failed = true;
          current.ended = true;
          current.turn.dataset.state = "error";
          saveFlight();
        }
        showError(msg.error);
        break;
      case "done":
        if (mine) {
          const aborted = current.finish === "abort";
          finishCurrent(current.failed ? "error" : aborted ? "aborted" : "done");
        }
        break;
      default:
        break; // pong and anything newer than this page
    }
  }

  // -- events -----------------------------------------------------------------------------
  ui.composer.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = ui.prompt.value.trim();
    if (!text || current) return;
    ui.prompt.value = "";
    startRequest(text);
  });

  ui.prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      ui.composer.requestSubmit();
    }
  });

  ui.stop.addEventListener("click", () => {
    if (!current) return;
    // While the socket is down the cancel goes out right after the resume.
    current.stopRequested = true;
    saveFlight();
    send({ type: "cancel", id: current.id });
  });

  ui.newChat.addEventListener("click", () => {
    if (current) send({ type: "cancel", id: current.id });
    current = null; // what still arrives for it is not part of the new chat
    history = [];
    shown = [];
    ui.messages.replaceChildren();
    clearError();
    saveChat();
    saveFlight();
    updateButtons();
  });

  ui.apiKey.addEventListener("change", () => {
    sessionStorage.setItem("tokenrelay.apiKey", ui.apiKey.value.trim());
    reconnect();
  });

  for (const [input, key] of [
    [ui.temperature, "tokenrelay.temperature"],
    [ui.maxTokens, "tokenrelay.maxTokens"],
  ]) {
    const saved = localStorage.getItem(key);
    if (saved !== null) input.value = saved;
    input.addEventListener("change", () => localStorage.setItem(key, input.value));
  }
  ui.apiKey.value = sessionStorage.getItem("tokenrelay.apiKey") || "";

  // -- after a reload: the conversation so far, and the answer that was in flight --------
  const saved = load(CHAT_KEY);
  if (saved && Array.isArray(saved.history) && Array.isArray(saved.shown)) {
    history = saved.history;
    shown = saved.shown;
    nextId = Number(saved.nextId) || 1;
    for (const turn of shown) showTurn(turn);
  }
  const flight = load(FLIGHT_KEY);
  if (flight && typeof flight.id === "string") {
    const turn = showTurn({ role: "assistant", text: flight.text || "", state: "streaming",
      finish: flight.finish, label: flight.label });
    current = { ...flight, text: flight.text || "", turn };
  }

  connect();
})();
