"""uvicorn's HTTP/1.1 protocol (h11) with the request deadlines it lacks.

uvicorn closes a kept-alive connection that stays idle after a response (``timeout_keep_alive``)
and limits the size of a request head (``h11_max_incomplete_event_size``), but has no deadline
while a request arrives: a connection that sends nothing, or a head or body one byte at a time
(slowloris), is kept open forever, and an ASGI middleware cannot help since it runs only once
the head is complete. This protocol adds two:

- ``header_timeout``: a connection must send a complete request head within this many seconds
  of opening, or of the end of its previous response. Not restarted by partial data.
- ``body_timeout``: while a request body arrives, the longest silence allowed between two
  pieces of it.

On expiry the connection is closed, after a 408 JSON answer if the client had begun a request
and no answer was started; a request the app was reading then ends as a client disconnect.

After a 408 the close is staged (RFC 9112, section 9.6): the server half-closes, then reads and
drops what the client still sends until the client closes or ``LINGER_SECONDS`` pass. Closing at
once would leave the client's in-flight bytes unread, and a socket closed with unread bytes sends a
reset instead of an orderly end: the client then fails with ECONNRESET around the 408.
"""

from __future__ import annotations

import json
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_SECONDS = 2.0  # after a 408, how long to read and drop the rest of the request


SCOPE_ID, SCOPE_STATUS = "captionkit.request_id", "captionkit.status"  # as serve/lifecycle.py's


def _timeout_answer(message: str, request_id: str | None) -> bytes:
    body = json.dumps({"error": message, "status": 408}).encode()
    # a request id as on every other answer: the one the app gave the request, or a new one for
    # a request whose head never arrived
    rid = (request_id or uuid.uuid4().hex).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (rid, len(body), body))


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self._deadline = None  # asyncio.TimerHandle of the armed deadline
        self._phase = None  # "head" or "body": what the armed deadline waits for
        self._linger = None  # asyncio.TimerHandle of the final close, once a 408 has been sent

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._update()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # the rest of a request already answered with a 408: dropped
        super().data_received(data)
        self._update(received=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def _update(self, received: bool = False) -> None:
        """Arm the deadline that fits what the connection waits for from the client now."""
        if self.transport.is_closing():
            return self._disarm()
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase is None:  # the request is complete: the app works or answers, no client deadline
            return self._disarm()
        if phase == self._phase and (phase == "head" or not received):
            return  # a head's deadline runs from its start; a body's restarts with each piece
        self._disarm()
        self._phase = phase
        timeout = self.header_timeout if phase == "head" else self.body_timeout
        self._deadline = self.loop.call_later(timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expire(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        if phase == "body" and self.flow.read_paused:  # the app is behind, not the client: wait on
            return self._update()
        if phase == "head":
            begun = bool(self.conn.trailing_data[0])  # part of a head is buffered
            message = f"no complete request head within {self.header_timeout:g} s"
        else:
            begun = self.cycle is not None and not self.cycle.response_started
            message = f"request body stalled for {self.body_timeout:g} s"
        if self.cycle is not None and not self.cycle.response_complete:
            # as connection_lost will: the app's next receive() is a disconnect, its answer is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        if not begun:
            return self.transport.close()
        scope = self.cycle.scope if self.cycle is not None else {}
        scope[SCOPE_STATUS] = 408  # for the access log: the client got this, not the app's answer
        self.transport.write(_timeout_answer(message, scope.get(SCOPE_ID)))
        if not self.transport.can_write_eof():
            return self.transport.close()
        self.transport.write_eof()  # sent once the answer is flushed: the client reads 408, then EOF
        self.flow.resume_reading()  # read on (and drop), so no unread bytes remain at the close
        self._linger = self.loop.call_later(LINGER_SECONDS, self.transport.close)
