"""The parts of uvicorn that are not its public API and that the frontend builds on, still where it reads them.

frontend/http_protocol.py subclasses uvicorn's two HTTP protocol classes and reads their state (the request
being served in `cycle`, the server's `connections`); frontend/process.py overrides uvicorn.Server's start,
stop and signal hooks. pyproject.toml pins uvicorn to the releases whose source was read for these (0.29:
the first with `Server.capture_signals`, through 0.54). A failure here names what moved: adapt those two
files to the new uvicorn, then widen the pin.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from pathlib import Path

import pytest
import uvicorn
from packaging.requirements import Requirement
from uvicorn.server import ServerState

from frontend.http_protocol import ReadDeadlines, protocol_class

DEADLINE_S = 5.0


def moved(what: str) -> str:
    return f"uvicorn {uvicorn.__version__}: {what}, which frontend/http_protocol.py or frontend/process.py relies on"


def test_the_installed_uvicorn_is_within_the_pinned_range():
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    pins = [Requirement(spec) for spec in re.findall(r'^\s*"(uvicorn\b[^"]*)"', pyproject, re.M)]
    assert len(pins) == 1 and str(pins[0].specifier), "pyproject.toml should pin uvicorn to a range"
    assert pins[0].specifier.contains(uvicorn.__version__), (
        f"uvicorn {uvicorn.__version__} is outside pyproject's {pins[0].specifier}: run this file's other tests "
        "against it before widening the pin"
    )


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_each_protocol_class_has_the_callbacks_the_frontend_overrides(parser):
    protocol = protocol_class(parser)
    callbacks = ["connection_made", "data_received", "connection_lost", "on_response_complete"]
    if parser == "httptools":  # llhttp's callbacks, where the header bytes are counted
        callbacks += ["on_message_begin", "on_url", "on_header", "on_headers_complete", "send_400_response"]
    uvicorn_base = protocol.__mro__[protocol.__mro__.index(ReadDeadlines) + 1]
    for name in callbacks:
        assert callable(getattr(uvicorn_base, name, None)), moved(f"{uvicorn_base.__name__} has no {name}")


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def set_protocol(self, protocol) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_a_protocol_shares_the_servers_connections_and_serves_a_request_through_its_cycle(parser):
    """ReadDeadlines reads `connections` (the server's set: ConnectionCap counts it) and `cycle` (None before
    a request, then its `more_body` until the body is in and its `response_complete` once answered)."""

    async def drive() -> None:
        answered = asyncio.Event()

        async def app(scope, receive, send):
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            answered.set()

        protocol_type = protocol_class(parser)
        config = uvicorn.Config(app, http=protocol_type, lifespan="off", log_level="warning")
        config.load()
        state = ServerState()
        protocol = protocol_type(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
        transport = FakeTransport()
        protocol.connection_made(transport)
        assert protocol.connections is state.connections and protocol in state.connections, moved(
            "a protocol's `connections` is no longer the server's set of connections"
        )
        assert protocol.loop is asyncio.get_running_loop() and protocol.transport is transport, moved(
            "a protocol no longer keeps `loop` and `transport`"
        )
        assert protocol.cycle is None, moved("`cycle` is not None before the first request")

        protocol.data_received(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        cycle = protocol.cycle
        assert cycle is not None and cycle.more_body and not cycle.response_complete, moved(
            "a request whose headers are in, but not its body, is no longer `cycle` with `more_body` set"
        )
        protocol.data_received(b"body")
        assert not cycle.more_body, moved("`cycle.more_body` stays set once the body is in")
        await asyncio.wait_for(answered.wait(), DEADLINE_S)
        assert cycle.response_complete, moved("`cycle.response_complete` is not set once the response is sent")
        assert transport.written.startswith(b"HTTP/1.1 200"), transport.written
        protocol.connection_lost(None)
        assert protocol not in state.connections

    asyncio.run(drive())


def test_config_takes_the_settings_the_frontend_passes():
    params = inspect.signature(uvicorn.Config).parameters
    for name in (
        "http",
        "log_level",
        "access_log",
        "timeout_graceful_shutdown",
        "timeout_keep_alive",
        "h11_max_incomplete_event_size",
    ):
        assert name in params, moved(f"uvicorn.Config takes no {name}")


def test_server_has_the_hooks_the_frontend_overrides():
    """AnnouncingServer: startup and shutdown (with their sockets), `started` read after startup, and SIGTERM
    routed to handle_exit inside capture_signals (uvicorn's own would also catch Ctrl-C, the launcher's)."""
    for name, params in (
        ("startup", ["self", "sockets"]),
        ("shutdown", ["self", "sockets"]),
        ("serve", ["self", "sockets"]),
        ("handle_exit", ["self", "sig", "frame"]),
        ("capture_signals", ["self"]),
    ):
        method = getattr(uvicorn.Server, name, None)
        assert method is not None, moved(f"uvicorn.Server has no {name}")
        assert list(inspect.signature(method).parameters) == params, moved(f"uvicorn.Server.{name}'s parameters")
    assert hasattr(uvicorn.Server(uvicorn.Config(app=None)), "started"), moved("uvicorn.Server has no `started`")
