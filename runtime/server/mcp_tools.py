"""`onepass mcp`: a stdio MCP server exposing noul, choice and score over a state.

Coding agents hand closed decisions to the engine instead of reasoning in text: each tool
returns the typed answer with its probabilities.
"""

from __future__ import annotations

from typing import Any

from mcp.server import MCPServer

from ..engine import Engine
from ..errors import OnepassError
from ..questions import Choice, Noul, Score


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
    def noul(state: str, instructions: str, true: str | None = None, false: str | None = None) -> dict[str, Any]:
        """Yes/no about `state`. Returns {"noul": P(yes)}. `true`/`false` may say what counts as yes/no."""
        criteria = {k: v for k, v in (("true", true), ("false", false)) if v}
        return _ask(engine, state, lambda: Noul(instructions, criteria or None))

    @server.tool()
    def choice(state: str, instructions: str, options: dict[str, str | None]) -> dict[str, Any]:
        """Pick one option (name -> description or null) about `state`; returns choice, probabilities, confidence."""
        return _ask(engine, state, lambda: Choice(instructions, options))

    @server.tool()
    def score(state: str, instructions: str, levels: list[str]) -> dict[str, Any]:
        """Rate `state` on 2..10 ordered levels (low to high); returns score, legend, probabilities, confidence."""
        return _ask(engine, state, lambda: Score(instructions, levels))

    return server


def serve_stdio(engine: Engine) -> None:
    """Run the MCP server on stdin/stdout until the client closes it."""
    build(engine).run("stdio")
