"""A flowing SSE stream written from the output hub's thread.

Why: every token of every stream used to cross threads twice in a web process: the
hub thread queued the entry and woke the request's thread, which framed the event and
wrote it. At 200 streams that hand-off (a futex wake, a GIL hand-over, ~4.5 context
switches per token) was most of the web tier's CPU per token (docs/benchmarks.md).
A stream whose events are plain deltas needs none of the request thread's judgement,
so while it flows the hub frames each entry and writes it to the client socket
itself (``broker.subscription.Subscription.start_pump``); the request thread sleeps in
``Run.next`` and wakes only for what needs it:

- an entry with anything but deltas (a choice's end, usage, an error): declined, so
  it reaches the request thread as before, which frames the end of the stream;
- a client socket that cannot take the whole write at once (a slow reader): the rest
  is kept (``leftover``) and the pump stops; the request thread writes it, blocking
  as any write of its own would, and the hub's buffer limits apply again;
- a write that fails (the client is gone): ``ClientGone`` from ``settle``;
- no entry for a keep-alive interval: the request thread's wait ends as before (a
  keep-alive comment unless the pump wrote meanwhile).

The pump writes the same bytes the request thread would: the same frames, and the
server's own chunked framing (``gunicorn.util.write``). It needs the server's
response object (``RESPONSE_KEY``, put there by ``web.head_first.HeadFirstWorker``)
and a plain blocking socket; under any other server, TLS, or ``sse_pump = false`` the
stream is written by its request thread only.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

from app.messages import OutputEvent, OutputKind
from broker.run import Item, Run
from broker.subscription import Pumped
from web import sse
from web.head_first import RESPONSE_KEY
from web.responses import ChunkStream
from web.resume import event_id

logger = logging.getLogger(__name__)


class ClientGone(ConnectionError):
    """A write to the client failed: it hung up."""


class SsePump:
    """The hub-thread writer of one SSE response (see the module's doc)."""

    def __init__(self, run: Run, chunks: ChunkStream, response: Any, sock: socket.socket) -> None:
        self.run = run
        self.chunks = chunks
        self.response = response
        self.sock = sock
        # Set on the hub's thread while pumping, read on the request's thread after
        # ``Run.next`` returned (which stops the pump first: never both at once).
        self.wrote = False  # something was written since ``start``
        self.leftover = b""  # the part of a write the socket did not take
        self.gone: OSError | None = None
        self.failed: Exception | None = None

    @classmethod
    def for_request(cls, environ: dict[str, Any], run: Run, chunks: ChunkStream) -> SsePump | None:
        """A pump for this request, or None when the server or socket cannot have one."""
        response = environ.get(RESPONSE_KEY)
        sock = getattr(response, "sock", None)
        if (
            response is None
            or not isinstance(sock, socket.socket)
            or isinstance(sock, ssl.SSLSocket)  # its send() takes no flags
            or environ.get("REQUEST_METHOD") == "HEAD"
        ):
            return None
        return cls(run, chunks, response, sock)

    def start(self) -> bool:
        """Before the request thread waits: pump if the response is under way and the
        socket blocks without a timeout (a timeout would make ``send`` wait for room)."""
        response = self.response
        if (
            not getattr(response, "headers_sent", False)
            or getattr(response, "response_length", None) is not None
            or self.sock.gettimeout() is not None
        ):
            return False
        self.wrote = False
        return self.run.hand_to(self._offer)

    def settle(self) -> None:
        """After the wait: write what the socket did not take; raise what went wrong."""
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed
        if self.gone is not None:
            raise ClientGone(str(self.gone)) from self.gone
        if self.leftover:
            data, self.leftover = self.leftover, b""
            try:
                self.sock.sendall(data)
            except OSError as exc:
                self.gone = exc
                raise ClientGone(str(exc)) from exc

    def _offer(self, eid: str, events: list[OutputEvent]) -> Pumped:
        """On the hub's thread: frame and write one entry of plain deltas."""
        if any(ev.kind is not OutputKind.DELTA for ev in events):
            return Pumped.DECLINED
        try:
            frames = frame_items(self.chunks, self.run.absorb(eid, events))
            if not frames:
                return Pumped.TAKEN
            data = "".join(frames).encode()
            response = self.response
            response.sent += len(data)
            wire = b"%X\r\n%s\r\n" % (len(data), data) if response.chunked else data
        except Exception as exc:  # a bug: the request thread ends the stream with it
            logger.exception("SSE pump of request %s failed", self.run.request_id)
            self.failed = exc
            return Pumped.TAKEN_LAST
        try:
            sent = self.sock.send(wire, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.gone = exc
            return Pumped.TAKEN_LAST
        self.wrote = True
        if sent < len(wire):
            self.leftover = wire[sent:]
            return Pumped.TAKEN_LAST
        return Pumped.TAKEN


def frame_items(chunks: ChunkStream, items: list[Item]) -> list[str]:
    """The SSE frames of one read's items, each with its cursor as ``id:``; stops at
    a request-level error (its error event is the last frame) or at the end."""
    frames: list[str] = []
    for item in items:
        cursor = event_id(item)
        frames += (sse.data_frame(j, cursor) for j in chunks.feed_json(item[1]))
        if chunks.error is not None:
            frames.append(sse.error_frame(chunks.error, cursor))
            break
        if chunks.ended:
            break
    return frames
