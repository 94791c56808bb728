// The tokenrelay chat page: one WebSocket to /v1/ws (protocol: docs/websocket.md).
// Vanilla JS, no build step. The page keeps the conversation itself and sends the whole
// history with every request, as a chat-completions client does.
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

  const history = []; // {role, content} turns sent with every request
  let socket = null;
  let retryMs = 500;
  let nextId = 1;
  let current = null; // the request in flight: {id, turn, text, userTurn, failed}

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
    setConnection("connecting", "connecting…");
    const ws = new WebSocket(socketUrl());
    socket = ws;
    ws.onopen = () => {
      if (socket !== ws) return;
      retryMs = 500;
      setConnection("open", "connected");
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
      if (current) {
        failCurrent({ message: "The connection was lost while generating." });
      }
      if (ev.code === 1008) {
        setConnection("closed", "not authorized");
        return; // reconnect when the API key changes
      }
      setConnection("closed", "disconnected, retrying…");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, 10000);
    };
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

  const FINISH_LABELS = {
    stop: "",
    length: "stopped: max tokens reached",
    abort: "stopped",
    error: "error",
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
    addTurn("user", text);
    const id = `c${nextId++}`;
    const turn = addTurn("assistant", "");
    turn.dataset.state = "streaming";
    current = { id, turn, text: "", userTurn, failed: false };

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
      const i = history.indexOf(req.userTurn);
      if (i >= 0 && req.failed) history.splice(i, 1);
    }
    updateButtons();
    ui.prompt.focus();
  }

  function onServerMessage(msg) {
    const mine = current && msg.id === current.id;
    switch (msg.type) {
      case "delta":
        if (mine && msg.choice === 0) {
          current.text += msg.text;
          current.turn.querySelector(".content").textContent = current.text;
          scrollDown();
        }
        break;
      case "final":
        if (mine && msg.choice === 0) {
          const reason = msg.finish_reason || "stop";
          current.turn.dataset.finish = reason;
          current.turn.querySelector(".finish").textContent = FINISH_LABELS[reason] ?? reason;
          if (reason === "error" && msg.error) showError(msg.error);
        }
        break;
      case "usage":
        if (mine && msg.usage) {
          const meta = current.turn.querySelector(".finish");
          const tokens = `${msg.usage.completion_tokens} tokens`;
          meta.textContent = meta.textContent ? `${meta.textContent} · ${tokens}` : tokens;
        }
        break;
      case "error":
        if (mine) {
          current.failed = true;
          current.turn.dataset.state = "error";
        }
        showError(msg.error);
        break;
      case "done":
        if (mine) {
          const aborted = current.turn.dataset.finish === "abort";
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
    if (current) send({ type: "cancel", id: current.id });
  });

  ui.newChat.addEventListener("click", () => {
    if (current) send({ type: "cancel", id: current.id });
    history.length = 0;
    ui.messages.replaceChildren();
    clearError();
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

  connect();
})();
