"""Reading a request body that cannot crash the server: size, compression and JSON limits before any work.

Every failure is a typed error (:mod:`onepass.runtime.server.errors`: MalformedBody, BodyTooLarge, InvalidRequest with
the field's path, ClientClosed when the client went away mid-body; the table there gives their statuses) naming what
was wrong and what is allowed; a client's value is repeated back at most ``ECHO_CHARS`` characters long:

* the body: at most ``limit`` bytes on the wire and after decompression (never more is produced);
* Content-Encoding zstd or gzip, verified to the end (gzip trailer CRC and length, zstd frame end
  and checksum); truncated or trailing bytes are refused;
* JSON: nested at most ``MAX_DEPTH`` deep (a deeper body is refused by a linear scan before the
  parser recurses), integers of at most ``MAX_INT_DIGITS`` digits, finite numbers only, and every
  key and string encodable as UTF-8 (no lone surrogates), no key twice in one object — each refused with the
  field's path or the key. Every check is linear in the body (``nesting_depth`` is vectorised).
"""

from __future__ import annotations

import json
import math
import zlib

import numpy as np
import zstandard
from starlette.requests import ClientDisconnect, Request

from ..core.errors import InvalidRequest, cut
from .errors import BodyTooLarge, ClientClosed, MalformedBody

MAX_DEPTH = 32  # objects and arrays inside one another; System One bodies need about 6
ECHO_CHARS = 200  # at most this much of a client's value is repeated in an answer or a log line
MAX_INT_DIGITS = 64
ZSTD_FEED = 256  # compressed bytes fed at a time, so one step can only produce a bounded output


def clip(value, limit: int = ECHO_CHARS) -> str:
    """A client's value as repeated back (an error message, a log line): its repr, cut to ``limit`` characters."""
    return cut(repr(value), limit)


async def read_raw(request: Request, limit: int) -> bytes:
    """The body as sent (still compressed), refused (BodyTooLarge) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is {declared} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the body exceeds {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientClosed("the client closed the connection before sending its whole body") from None
    return b"".join(chunks)


def decode(raw: bytes, encoding: str, limit: int) -> bytes:
    """Undo Content-Encoding (zstd, gzip, identity): at most ``limit`` bytes out, the whole stream verified."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding == "zstd":
        return _zstd(raw, limit)
    if encoding in ("gzip", "x-gzip"):
        return _gzip(raw, limit)
    raise MalformedBody(f"Content-Encoding {clip(encoding)} is not supported; use zstd, gzip or none")


def _too_big(limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"the decompressed body exceeds {limit} bytes")


def _gzip(raw: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as err:
        raise MalformedBody(f"the body is not valid gzip: {err}") from None
    if len(out) > limit:
        raise _too_big(limit)
    if not d.eof:
        raise MalformedBody("the gzip body is truncated (no end of stream, CRC or length)")
    if d.unused_data:
        raise MalformedBody(f"the gzip body has {len(d.unused_data)} bytes after its end; send one gzip member")
    return out


def _zstd(raw: bytes, limit: int) -> bytes:
    d = zstandard.ZstdDecompressor().decompressobj()
    out, size = [], 0
    try:
        for i in range(0, len(raw), ZSTD_FEED):
            if d.eof:
                raise MalformedBody(f"the zstd body has {len(raw) - i} bytes after its frame; send one frame")
            piece = d.decompress(raw[i:i + ZSTD_FEED])
            size += len(piece)
            if size > limit:
                raise _too_big(limit)
            out.append(piece)
    except zstandard.ZstdError as err:
        raise MalformedBody(f"the body is not valid zstd: {err}") from None
    if not d.eof:
        raise MalformedBody("the zstd body is truncated (its frame does not end)")
    if d.unused_data:
        raise MalformedBody(f"the zstd body has {len(d.unused_data)} bytes after its frame; send one frame")
    return b"".join(out)


class _Refused:
    """A number the parser met that the body may not carry; reported with its path after parsing."""

    def __init__(self, why: str):
        self.why = why


def _int(text: str):
    digits = len(text.lstrip("-"))
    return _Refused(f"an integer of {digits} digits; at most {MAX_INT_DIGITS} are allowed") \
        if digits > MAX_INT_DIGITS else int(text)


def _float(text: str):
    value = float(text)
    return value if math.isfinite(value) else _Refused(f"the number {text[:20]} is out of range")


def _constant(text: str):
    return _Refused(f"{text} is not a JSON number; send a finite number")


def nesting_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (brackets inside strings do not count); linear and
    vectorised, whatever the text (a regex over strings was quadratic on runs of escaped quotes: 64 KiB took 10 s).

    A quote is escaped when the run of backslashes just before it has odd length; the unescaped quotes toggle
    in and out of strings; brackets count outside strings only. Exact for valid JSON; for invalid JSON it is
    some depth of its brackets, and the parser refuses the text anyway."""
    b = np.frombuffer(raw, dtype=np.uint8)
    if b.size == 0:
        return 0
    slash = b == 0x5C
    count = np.cumsum(slash, dtype=np.int32)  # backslashes up to and including each byte (bodies < 2 GiB)
    last_other = np.maximum.accumulate(np.where(slash, 0, count))  # ... up to the last byte that is not one
    run = count - last_other  # the backslash run ending at each byte
    before = np.concatenate(([0], run[:-1]))  # ... ending just before it
    quote = (b == 0x22) & (before % 2 == 0)
    outside = (np.cumsum(quote, dtype=np.int32) & 1) == 0  # quotes themselves are no brackets: either is fine
    step = (np.isin(b, (0x5B, 0x7B)).astype(np.int32) - np.isin(b, (0x5D, 0x7D)).astype(np.int32)) * outside
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def parse_json(raw: bytes):
    """The body as JSON, within the depth, number and text limits; a typed error (its field named) otherwise."""
    if nesting_depth(raw) > MAX_DEPTH:
        raise MalformedBody(f"the body nests arrays/objects more than {MAX_DEPTH} deep; at most {MAX_DEPTH} "
                             "are allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MalformedBody(f"the body is not valid UTF-8 (byte {err.start}); send UTF-8 JSON") from None
    try:
        data = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant,
                          object_pairs_hook=_unique)
    except json.JSONDecodeError as err:
        raise MalformedBody(f"the body is not valid JSON: {err}") from None
    except RecursionError:  # the depth scan makes this unreachable; kept as a guard
        raise MalformedBody(f"the body nests more than {MAX_DEPTH} deep") from None
    _check_values(data)
    return data


def _unique(pairs: list) -> dict:
    """A JSON object whose keys are all different: a repeated key (the last one would silently win for the state,
    a question id or an option) is refused, naming it."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise MalformedBody(f"the key {clip(key)} appears twice in one JSON object; keys must be unique")
    return out


def _check_values(data) -> None:
    """Walk the parsed body (iteratively): refused numbers and strings UTF-8 cannot encode, by path."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path, is_key=True)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, _Refused):
            raise _refused(path, value.why)


def _check_text(text: str, path: tuple, is_key: bool = False) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = "a key" if is_key else "a string"
        raise _refused(path, f"{where} is not valid UTF-8 text (a lone surrogate at character {err.start}); "
                             "send UTF-8 text") from None


def _refused(path: tuple, why: str) -> InvalidRequest:
    """InvalidRequest (422) naming the field at ``path`` (keys UTF-8 cannot encode shown as "?")."""
    loc = [p if isinstance(p, int) or _printable(p) else "?" for p in path]
    err = InvalidRequest(why, ".".join(map(str, loc)) or None)
    err.loc = loc
    return err


def _printable(key: str) -> bool:
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
