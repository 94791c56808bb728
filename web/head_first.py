"""The web tier's gunicorn worker: gthread that reads each request's head (and a small
body) in its event loop before it spends a thread on it.

Why: gunicorn's gthread worker gives a connection a thread as soon as it sends its first
byte, and that thread then blocks in the HTTP parser until the headers are complete. A
slowloris client (a request line, then one header line every few seconds, never the
blank line) therefore pins one thread per socket, forever: 420 of them took the default
2 x 192 threads and nobody else got an answer (issue 16, line 2).

This worker keeps the thread pool (SSE streams and WebSockets block in Redis between
events, and real threads need no monkey-patching of redis-py, Celery or the tokenizer,
which gevent would) but moves the slow part into the main loop, where a waiting socket
costs a few hundred bytes and no thread:

- A new connection, or a kept-alive one that becomes readable, is read without blocking
  until its head is complete (the blank line) and, when it declares a ``Content-Length``
  of at most ``PREBUFFER_BYTES`` with no ``Expect: 100-continue``, until its body is too.
  Only then does a thread parse it, from memory.
- The head must arrive within ``header_timeout_s`` and a pre-buffered body within
  ``body_timeout_s`` after it; a connection that misses either gets ``408`` and is
  closed. A head larger than ``HEAD_LIMIT`` goes to the parser at once, which refuses it.
- A larger or chunked body is read by its thread as gunicorn does, but every read waits
  at most ``body_timeout_s`` for the next bytes (then ``SlowBody``, a 408 to the client).
- ``worker_connections`` caps the sockets one worker holds, waiting ones included; past
  it the worker stops accepting and new connections wait in the kernel's backlog.
- A connection closed after its response (``Connection: close``, a 408, an error) lingers
  in the event loop: its unread bytes are drained there until the client closes its side
  or ``LINGER_S`` is up. gunicorn (27) drains it on the loop's own thread instead, which
  then serves nobody else meanwhile: a client that never closed its side held a worker
  still for 2 s per connection.

Measured against the alternatives in docs/benchmarks.md (``benchmarks/slowloris.py``).
TLS is not terminated here (put a proxy in front, docs/security.md); with gunicorn's own
TLS the worker falls back to plain gthread behaviour.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import select
import selectors
import socket
import threading
import time
from functools import partial
from typing import Any

from gunicorn.workers.gthread import TConn, ThreadWorker

#: The WSGI environ key of gunicorn's response object for the request (``load_wsgi``).
RESPONSE_KEY = "tokenrelay.server_response"
#: Bodies up to this size (declared by Content-Length) are read in the event loop;
#: every chat or completion request is far below it.
PREBUFFER_BYTES = 1024 * 1024
#: A head that grows past this without its blank line goes to the parser, which
#: answers 431/400 (gunicorn's own limits are lower for any one line or field).
HEAD_LIMIT = 64 * 1024
#: One recv() in the event loop.
RECV_BYTES = 64 * 1024
#: A connection closed after its response waits at most this long, and reads at most
#: this much, for its client to close its side (RFC 9112 section 9.6, gunicorn's
#: ``close_graceful``): closing with unread bytes would reset the response.
LINGER_S = 2.0
LINGER_BYTES = 64 * 1024
SLOW_REQUEST_MESSAGE = "The request did not arrive in time."
_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": SLOW_REQUEST_MESSAGE,
            "type": "timeout_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)

_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d+)[ \t]*$", re.I | re.M)
_CHUNKED_OR_EXPECT = re.compile(rb"^(transfer-encoding|expect)[ \t]*:", re.I | re.M)


class SlowBody(Exception):
    """A request body's next bytes did not arrive within ``body_timeout_s``.

    Not an ``OSError``: werkzeug turns those into a 400 "client disconnected", and the
    client is still there, just too slow (the app answers 408)."""


def head_complete(buffered: bytes | bytearray) -> tuple[bool, bool]:
    """Whether ``buffered`` holds enough for a thread to parse without waiting: a whole
    head and, if it declares a small body, that body. Returns ``(ready, body_buffered)``;
    ``body_buffered`` False means the thread will read (part of) the body itself."""
    end = buffered.find(b"\r\n\r\n")
    if end < 0:
        return len(buffered) > HEAD_LIMIT, False
    head = bytes(buffered[:end])
    if _CHUNKED_OR_EXPECT.search(head):
        return True, False
    lengths = _CONTENT_LENGTH.findall(head)
    if len(lengths) != 1:  # none: no body; several: the parser refuses the request
        return True, True
    length = int(lengths[0])
    if length > PREBUFFER_BYTES:
        return True, False
    return len(buffered) >= end + 4 + length, True


class _PatientSocket:
    """The parser's view of a socket whose body is read in a thread: each ``recv`` waits
    at most ``timeout`` for the next bytes. The socket itself stays blocking, without a
    timeout, for the response (an SSE stream or a WebSocket may sit idle for long)."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout

    def recv(self, size: int) -> bytes:
        ready, _, _ = select.select([self._sock], [], [], self._timeout)
        if not ready:
            raise SlowBody(f"no request bytes for {self._timeout:g} s")
        return self._sock.recv(size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Conn(TConn):  # type: ignore[misc]
    """gthread's connection, whose graceful close lingers in the worker's event loop."""

    def __init__(self, worker: HeadFirstWorker, *args: Any) -> None:
        super().__init__(*args)
        self.worker = worker

    def close(self, graceful: bool = False) -> None:
        if not graceful:
            super().close()
        elif threading.current_thread() is threading.main_thread():  # ``finish_request``
            self.worker.linger(self.sock)
        else:
            super().close(graceful=True)


class HeadFirstWorker(ThreadWorker):  # type: ignore[misc]
    """gthread whose event loop, not a thread, waits for each request's head."""

    #: Set by ``web.__main__`` from settings before gunicorn forks the workers.
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    #: SIGTERM: streams still open this long after it are handed over (``handle_exit``).
    drain_s = 20.0
    #: The WSGI app: gunicorn's ``load_wsgi`` sets it, ``load_wsgi`` below wraps it.
    wsgi: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Connections reading their head, with their deadline (checked once a loop).
        self.heads: dict[TConn, float] = {}
        # Closed connections waiting for their client's side: [deadline, bytes read].
        self.lingering: dict[socket.socket, list[float]] = {}

    # -- gthread's hooks -----------------------------------------------------------------

    def load_wsgi(self) -> None:
        """The app, told of gunicorn's response object (``RESPONSE_KEY``):
        a streamed response's frames may then be written from the output hub's thread,
        framed as gunicorn frames its own writes."""
        super().load_wsgi()
        app = self.wsgi
        self.app = app

        def with_response(environ: dict[str, Any], start_response: Any) -> Any:
            environ[RESPONSE_KEY] = getattr(start_response, "__self__", None)
            return app(environ, start_response)

        self.wsgi = with_response

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM: gunicorn stops accepting and waits for open connections (at most its
        ``graceful_timeout``, a little above ``drain_s``); the streams still open after
        ``drain_s`` are then handed over: they end without their final event and
        their clients resume on another process (``Runner.close_streams``)."""
        super().handle_exit(sig, frame)
        if getattr(self, "draining", None) is None:
            self.draining = threading.Timer(self.drain_s, self._hand_streams_over)
            self.draining.daemon = True
            self.draining.start()

    def _hand_streams_over(self) -> None:
        from web.context import runner_of

        try:
            runner_of(self.app).close_streams()
        except Exception:  # no app (a failed start), or a bug: gunicorn's kill follows
            self.log.exception("could not hand the open streams over")

    def accept(self, listener: socket.socket) -> None:
        if self.cfg.is_ssl:
            super().accept(listener)
            return
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._read_head(_Conn(self, self.cfg, client_sock, client_addr, listener.getsockname()))

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        """A kept-alive connection's next request: its head, too, is read here."""
        if self.cfg.is_ssl:
            super().on_client_socket_readable(conn, client)
            return
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._read_head(conn)

    def murder_pending(self) -> None:
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c, deadline in self.heads.items() if deadline <= now]:
            self._forget(conn)
            with contextlib.suppress(OSError):
                conn.sock.send(TIMEOUT_RESPONSE)  # non-blocking; best effort
            self.nr_conns -= 1
            conn.close()
        self._drain_lingering(now)

    def handle(self, conn: TConn) -> Any:
        buffered: bytes | None = getattr(conn, "buffered", None)
        if buffered is not None:
            conn.buffered = None
            conn.sock.setblocking(True)
            conn.init()
            conn.parser.unreader.unread(buffered)
            if not conn.body_buffered:
                conn.parser.unreader.sock = _PatientSocket(conn.sock, self.body_timeout_s)
            elif isinstance(conn.parser.unreader.sock, _PatientSocket):
                conn.parser.unreader.sock = conn.sock
        return super().handle(conn)

    def handle_error(self, req: Any, client: socket.socket, addr: Any, exc: Exception) -> None:
        if isinstance(exc, SlowBody):
            # Only while gunicorn drains a body the app did not read, after the response:
            # nothing more to say; the connection is closed.
            self.log.debug("closing a connection whose unread body stalled: %s", exc)
            return
        super().handle_error(req, client, addr, exc)

    # -- the head-reading phase ----------------------------------------------------------

    def _read_head(self, conn: TConn) -> None:
        conn.sock.setblocking(False)
        conn.head = bytearray()
        conn.body_buffered = True
        self.heads[conn] = time.monotonic() + self.header_timeout_s
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_readable, conn))

    def _on_head_readable(self, conn: TConn, _sock: socket.socket) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away before its request was complete
            self._forget(conn)
            self.nr_conns -= 1
            conn.close()
            return
        head: bytearray = conn.head
        had_head = b"\r\n\r\n" in head
        head += data
        ready, body_buffered = head_complete(head)
        if not ready:
            if not had_head and b"\r\n\r\n" in head:  # the body's own deadline starts now
                self.heads[conn] = time.monotonic() + self.body_timeout_s
            return
        self._forget(conn)
        conn.buffered = bytes(head)
        conn.head = bytearray()
        conn.body_buffered = body_buffered
        conn.data_ready = True  # gthread must not wait for (or defer) this one again
        self.enqueue_req(conn)

    def _forget(self, conn: TConn) -> None:
        self.heads.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.poller.unregister(conn.sock)

    # -- the closing phase ---------------------------------------------------------------

    def linger(self, sock: socket.socket) -> None:
        """Close ``sock`` after its response without waiting here: send our FIN now,
        then, once a loop, drain what the client still sends until it closes its side
        too (or ``LINGER_S``, ``LINGER_BYTES``), so that the response is not reset.

        The socket is neither made non-blocking nor registered with the poller: a
        WebSocket's reader thread (simple-websocket) may still read it and close it, so
        only the socket object is held, and a closed one is dropped."""
        if len(self.lingering) >= self.worker_connections:
            with contextlib.suppress(OSError):
                sock.close()
            return
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            with contextlib.suppress(OSError):
                sock.close()
            return
        self.lingering[sock] = [time.monotonic() + LINGER_S, 0]

    def _drain_lingering(self, now: float) -> None:
        for sock, entry in list(self.lingering.items()):
            done = sock.fileno() == -1 or entry[0] <= now
            while not done:
                try:
                    # Readable first: a socket with a timeout would wait in recv for it.
                    if not select.select([sock], [], [], 0)[0]:
                        break
                    data = sock.recv(RECV_BYTES, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except (OSError, ValueError):  # closed meanwhile by its WebSocket's thread
                    data = b""
                entry[1] += len(data)
                done = not data or entry[1] >= LINGER_BYTES
            if done:
                del self.lingering[sock]
                with contextlib.suppress(OSError):
                    sock.close()
