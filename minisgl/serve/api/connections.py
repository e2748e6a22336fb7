"""HTTP connections: drop clients that never finish sending their request headers.

uvicorn's h11 protocol waits forever for the headers of a request (5,000 half-open connections
were held open in a test), and its keep-alive timer stops at the first byte. This protocol
closes a connection when no complete request head arrives within ``HEADER_TIMEOUT_S`` of it
opening or of its previous response.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutProtocol(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(HEADER_TIMEOUT_S, self._expire, self.cycle)

    def _expire(self, cycle_when_armed: object) -> None:
        """No new request began since the timer was armed: the client is stalling."""
        if self.cycle is cycle_when_armed and not self.transport.is_closing():
            self.transport.close()
