"""`onepass mcp`: a stdio MCP server exposing noul, choice and score over a state.

Coding agents hand closed decisions to the engine instead of reasoning in text: each tool
returns the typed answer with its probabilities.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, BinaryIO

import anyio
import anyio.to_thread
import mcp_types
from mcp.server import MCPServer
from mcp.server.stdio import stdio_server
from pydantic import ValidationError

from ..core.engine import Engine
from ..core.errors import OnepassError
from ..core.questions import Choice, Noul, Score


def _ask(engine: Engine, state, make) -> dict:
    """The typed answer, or {"error": message}. Questions validate on construction, so build them here."""
    try:
        return engine.ask(state, {"q": make()})["q"].to_wire()
    except OnepassError as err:
        return {"error": str(err)}


def build(engine: Engine) -> MCPServer:
    """An MCP server with three tools bound to ``engine``."""
    server = MCPServer("onepass", instructions=(
        "Closed decisions about a text, answered by a local decision engine with probabilities. "
        "Use noul for yes/no, choice to pick one of named options, score to rate on ordered levels."))

    @server.tool()
    def noul(state: str, instructions: str, true: str | None = None, false: str | None = None,
             task: str | None = None) -> dict[str, Any]:
        """Yes/no about `state`. Returns {"noul": P(yes)}. `true`/`false` may say what counts as yes/no; `task`
        names one of the engine's tuned tasks (as every tool's)."""
        criteria = {k: v for k, v in (("true", true), ("false", false)) if v}
        return _ask(engine, state, lambda: Noul(instructions, criteria or None, task))

    @server.tool()
    def choice(state: str, instructions: str, options: dict[str, str | None], task: str | None = None) -> dict[str, Any]:
        """Pick one option (name -> description or null) about `state`; returns choice, probabilities, confidence."""
        return _ask(engine, state, lambda: Choice(instructions, options, task))

    @server.tool()
    def score(state: str, instructions: str, levels: list[str], task: str | None = None) -> dict[str, Any]:
        """Rate `state` on 2..10 ordered levels (low to high); returns score, legend, probabilities, confidence."""
        return _ask(engine, state, lambda: Score(instructions, levels, task))

    return server


# -- the stdio wire ---------------------------------------------------------------------------------
# The mcp SDK's own stdio transport hands a line it cannot parse to the session as an exception, which
# logs it and answers nothing: a junk line, invalid UTF-8 or a string holding a lone surrogate (valid JSON,
# not Unicode text) leaves the client waiting for an answer that never comes. Lines are screened here
# first and every one the SDK could not take is answered with a JSON-RPC error; the rest reach the SDK's
# session unchanged. Blank lines are not messages and are skipped.

log = logging.getLogger("onepass.mcp")
MAX_LINE_BYTES = 8 << 20  # one message; a longer line is answered with an error and skipped, never buffered


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


DROP = "drop"  # a line that gets no answer by JSON-RPC's rules (a notification, or the client's own response)


def _unicode(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def refusal(line: bytes) -> dict | str | None:
    """What answers ``line``: None when it is a message the SDK can take; else the JSON-RPC error to send (a dict),
    or DROP (logged) for a notification or a response that is not Unicode text, which JSON-RPC never answers.

    An error carries the request's id only where the line is a request (a method and a string or integer id);
    otherwise its id is null, so it can never be taken for the answer to another request."""
    def error(code: int, message: str, ident=None) -> dict:
        return {"jsonrpc": "2.0", "id": ident, "error": {"code": code, "message": message}}

    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return error(mcp_types.PARSE_ERROR, f"Parse error: the line is not UTF-8 (byte {err.start})")
    try:
        message = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        return error(mcp_types.PARSE_ERROR, f"Parse error: {str(err)[:200]}")
    if not isinstance(message, dict):
        return error(mcp_types.INVALID_REQUEST, "Invalid Request: a JSON-RPC 2.0 object is expected (one per line)")
    ident = message.get("id")
    if "id" in message and (not isinstance(ident, (str, int)) or isinstance(ident, bool) or not _unicode(ident)):
        return error(mcp_types.INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
    request = "method" in message and "id" in message
    if not _unicode(message):
        if not request:
            log.warning("dropped a %s that is not Unicode text (a lone surrogate)",
                        "notification" if "method" in message else "response")
            return DROP
        if not _unicode(message.get("method")):
            return error(mcp_types.INVALID_REQUEST, "Invalid Request: the method is not Unicode text", ident)
        return error(mcp_types.INVALID_PARAMS, "Invalid params: a string holds a lone surrogate (\\ud800-\\udfff), "
                     "which is not Unicode text", ident)
    if "method" not in message and "result" not in message and "error" not in message:  # neither kind: say what
        return error(mcp_types.INVALID_REQUEST, "Invalid Request: the message has no method; a request needs a "
                     "'method' (and an 'id' to be answered)")
    try:
        mcp_types.jsonrpc_message_adapter.validate_python(message, by_name=False)
    except ValidationError as err:
        what = "request" if request else "notification" if "method" in message else "response"
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"][1:]) or "the message"
        return error(mcp_types.INVALID_REQUEST, f"Invalid Request: not a valid JSON-RPC 2.0 {what}: {where}: "
                     f"{first['msg']}", ident if request else None)
    return None


async def serve_lines(server: MCPServer, wire_in: BinaryIO, wire_out: BinaryIO) -> None:
    """Serve ``server`` over newline-delimited JSON-RPC on two binary streams until ``wire_in`` ends, answering
    every line the SDK cannot take with a JSON-RPC error (see :func:`refusal`)."""
    lock = anyio.Lock()

    def write(data: bytes) -> None:
        wire_out.write(data)
        wire_out.flush()

    async def send(data: bytes) -> None:
        async with lock:  # the SDK's answers and these errors share one wire: whole lines, never interleaved
            await anyio.to_thread.run_sync(write, data)

    class Lines:  # what the SDK's transport reads: the lines it can take
        def __aiter__(self):
            return self.lines()

        async def lines(self):
            while line := await anyio.to_thread.run_sync(wire_in.readline, MAX_LINE_BYTES + 2):
                if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:  # a line ending exactly at the limit is kept
                    while line and not line.endswith(b"\n"):  # the rest of the line, discarded as it comes
                        line = await anyio.to_thread.run_sync(wire_in.readline, 1 << 20)
                    answer = {"jsonrpc": "2.0", "id": None, "error": {"code": mcp_types.INVALID_REQUEST, "message":
                              f"Invalid Request: a line is at most {MAX_LINE_BYTES} bytes"}}
                elif not line.strip():
                    continue
                else:
                    answer = refusal(line)
                    if answer is None:
                        yield line.decode("utf-8")
                        continue
                    if answer == DROP:
                        continue
                await send(json.dumps(answer, separators=(",", ":")).encode() + b"\n")

    class Out:  # where the SDK writes its answers
        async def write(self, text: str) -> None:
            await send(text.encode("utf-8"))

        async def flush(self) -> None:
            pass

    async with stdio_server(Lines(), Out()) as (read_stream, write_stream):
        low = server._lowlevel_server  # what MCPServer.run_stdio_async runs; no public hook takes other streams
        await low.run(read_stream, write_stream, low.create_initialization_options())


def serve_stdio(engine: Engine) -> None:
    """Run the MCP server on stdin/stdout until the client closes it. While it runs, fd 0 reads the null device
    and fd 1 writes to stderr, so stray output from libraries never corrupts the wire (as the SDK does)."""
    wire_in, wire_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")  # closed on the way out
    saved = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)
    os.close(null)
    try:
        anyio.run(serve_lines, build(engine), wire_in, wire_out)
    finally:
        wire_in.close()
        wire_out.close()
        for fd, old in zip((0, 1), saved):
            os.dup2(old, fd)
            os.close(old)
