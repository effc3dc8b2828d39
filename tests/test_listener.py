"""The HTTP listening socket the launcher binds and every frontend accepts on."""

from __future__ import annotations

import asyncio
import socket

from launch import bind_listener


def test_accepted_connections_send_small_writes_at_once():
    """Nagle's algorithm is off on every connection (TCP_NODELAY): with it on, the second part of a response
    (or the next streamed token) waits for the client's delayed ACK, ~40 ms per request on a keep-alive
    connection. asyncio, as uvicorn serves the launcher's socket, sets it where the socket says it is TCP."""
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, timeout=10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
