"""`onepass mcp` answers every line of its stdio wire: a JSON-RPC result, or a JSON-RPC error for a line it
cannot take (junk, invalid UTF-8, a lone surrogate, NaN, an array, a message without a method, deep nesting,
a line over the size limit); the session goes on after each. The tiny Llama's engine: what is tested here does
not depend on the weights.

Negative control: the mcp SDK's own stdio transport (what `onepass mcp` ran before) answers none of these
lines: a ``ping`` sent after a junk line gets the first answer.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("mcp")

from onepass.runtime.server.mcp_tools import MAX_LINE_BYTES, refusal  # noqa: E402

INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}}
INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
PING = {"jsonrpc": "2.0", "id": 99, "method": "ping"}
SURROGATE = (b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"noul","arguments":'
             b'{"state":"\\ud800","instructions":"Refund?"}}}')

# (line, the id the error must carry, its JSON-RPC code)
JUNK = [
    (b"hello junk", None, -32700),
    (b"\xff\xfe{}", None, -32700),  # not UTF-8
    (SURROGATE, 7, -32602),  # valid JSON, not Unicode text: the SDK's parser refuses it, the id is kept
    (b"NaN", None, -32700),
    (b"[1, 2]", None, -32600),
    (b'{"jsonrpc": "2.0", "id": 8}', None, -32600),  # no method: a (bad) response, whose id is the server's
    (b'{"jsonrpc": "1.0", "id": "a", "method": "ping"}', "a", -32600),
    (b"[" * 100_000, None, -32700),  # deeper than any parser recurses
    (b'{"jsonrpc": "2.0", "id": true, "method": "ping"}', None, -32600),  # ids that are no id: the SDK took these
    (b'{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', None, -32600),  # for notifications and answered nothing
    (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}', None, -32600),
    (b'{"jsonrpc": "2.0", "id": 4, "result": "not an object"}', None, -32600),  # a response's id is the server's
    (b'{"jsonrpc": "2.0", "id": 9, "method": "\\udc00"}', 9, -32600),
]


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _send(proc: subprocess.Popen, line: bytes) -> None:
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()


def _read(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    assert line, "the server closed its stdout"
    return json.loads(line)


@pytest.fixture(scope="module")
def mcp_server(tiny_engine_dir):
    proc = _start([sys.executable, "-m", "onepass", "mcp", "--engine", str(tiny_engine_dir),
                   "--backend", "onnxruntime"])
    _send(proc, json.dumps(INIT).encode())
    assert _read(proc)["id"] == 1
    _send(proc, json.dumps(INITIALIZED).encode())
    yield proc
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


@pytest.mark.parametrize("line,ident,code", JUNK, ids=[str(i) for i in range(len(JUNK))])
def test_every_junk_line_gets_a_jsonrpc_error_and_the_session_goes_on(mcp_server, line, ident, code):
    _send(mcp_server, line)
    answer = _read(mcp_server)
    assert answer["jsonrpc"] == "2.0" and answer["id"] == ident, answer
    assert answer["error"]["code"] == code, answer
    _send(mcp_server, json.dumps(PING).encode())
    assert _read(mcp_server) == {"jsonrpc": "2.0", "id": 99, "result": {}}


def test_notifications_and_responses_that_are_not_unicode_get_no_answer(mcp_server):
    """JSON-RPC never answers a notification, and a response's id is the server's own: both are logged, not answered
    (the ping's answer is the first line that comes back)."""
    _send(mcp_server, b'{"jsonrpc": "2.0", "method": "notifications/progress", "params": {"x": "\\ud800"}}')
    _send(mcp_server, b'{"jsonrpc": "2.0", "id": 3, "result": {"x": "\\udc00"}}')
    _send(mcp_server, json.dumps(PING).encode())
    assert _read(mcp_server) == {"jsonrpc": "2.0", "id": 99, "result": {}}


def test_blank_lines_are_skipped_and_a_tool_call_still_answers(mcp_server):
    _send(mcp_server, b"   ")
    call = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "noul", "arguments": {
        "state": "I was charged twice.", "instructions": "Was the customer charged twice?"}}}
    _send(mcp_server, json.dumps(call).encode())
    answer = _read(mcp_server)  # the blank line got nothing: the first answer is the call's
    assert answer["id"] == 5 and 0.0 <= answer["result"]["structuredContent"]["noul"] <= 1.0


def _ping_of(size: int) -> bytes:
    head, tail = b'{"jsonrpc":"2.0","id":3,"method":"ping","params":{"x":"', b'"}}'
    return head + b"a" * (size - len(head) - len(tail)) + tail


def test_a_line_at_the_limit_is_read_and_one_byte_over_is_refused_without_being_kept(mcp_server):
    _send(mcp_server, _ping_of(MAX_LINE_BYTES))
    assert _read(mcp_server) == {"jsonrpc": "2.0", "id": 3, "result": {}}
    _send(mcp_server, _ping_of(MAX_LINE_BYTES + 1))
    answer = _read(mcp_server)
    assert answer["id"] is None and answer["error"]["code"] == -32600
    assert str(MAX_LINE_BYTES) in answer["error"]["message"]
    _send(mcp_server, json.dumps(PING).encode())
    assert _read(mcp_server)["id"] == 99


def test_the_screen_lets_every_valid_message_through():
    for message in (INIT, INITIALIZED, PING, {"jsonrpc": "2.0", "id": 4, "result": {}},
                    {"jsonrpc": "2.0", "id": 4, "error": {"code": 1, "message": "m"}},
                    {"jsonrpc": "2.0", "id": 6, "method": "tools/call", "params": {"name": "noul", "arguments": {
                        "state": "é 中 \U0001f600", "instructions": "?"}}}):
        assert refusal(json.dumps(message).encode()) is None, message
        assert refusal(json.dumps(message, ensure_ascii=False).encode()) is None, message


def test_negative_control_the_sdk_transport_leaves_junk_unanswered(tiny_engine_dir):
    """Before: MCPServer.run("stdio"): the junk line is dropped in silence and the ping's answer comes first."""
    script = ("import sys; from onepass import Engine; from onepass.runtime.server.mcp_tools import build; "
              "build(Engine.load(sys.argv[1], backend='onnxruntime')).run('stdio')")
    proc = _start([sys.executable, "-c", script, str(tiny_engine_dir)])
    try:
        _send(proc, json.dumps(INIT).encode())
        assert _read(proc)["id"] == 1
        _send(proc, json.dumps(INITIALIZED).encode())
        _send(proc, b"hello junk")
        _send(proc, json.dumps(PING).encode())
        assert _read(proc)["id"] == 99
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
