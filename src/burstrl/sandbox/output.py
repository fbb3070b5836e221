"""A command's output, capped in the bytes it takes on the wire (the head and the tail kept).

Why a module of its own: what an exec returns travels JSON-escaped (`ensure_ascii`), where one
raw byte may cost 1, 2, 6 or 12 bytes, so the cap must be counted on the escaped text, not on the
bytes read (issue 37); measuring that, a slice at a time so that nothing large is ever escaped or
decoded whole, is its own piece of arithmetic, apart from running commands (`runtime`).
Standard library only: the daemon imports it inside sandbox images.
"""

from __future__ import annotations

import codecs
from json.encoder import encode_basestring_ascii as _escape  # the C escaper json.dumps uses
from typing import List

WIRE_SLICE = 65536  # output is decoded and measured on the wire this many bytes (characters) at a time


class OutputCapture:
    """One stream's output within `limit` bytes on the wire: the head and the tail, gap counted.

    Why the wire: the text travels JSON-escaped with `ensure_ascii`, where an undecodable byte
    becomes U+FFFD, sent as the 6 bytes `\\ufffd` (a control byte as `\\u0001`, a 4-byte character
    as 12), so a cap counted in raw bytes let `head -c 64M /dev/urandom` send ~384 MiB and run
    the daemon out of memory (issue 37). Raw bytes are kept up to the cap (each costs at least
    one byte on the wire, so no more can fit); `text()` keeps the longest head and tail whose
    escaped form fits each half, and counts what it drops in `elided` (raw bytes).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.head_cap = limit // 2
        self.tail_cap = limit - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.elided = 0

    def feed(self, data: bytes) -> None:
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            extra = len(self.tail) - self.tail_cap
            if extra > 0:
                del self.tail[:extra]
                self.elided += extra

    def text(self) -> str:
        """The output as text whose JSON string is at most `limit` bytes (plus the elision note)."""
        if not self.elided:  # head and tail are contiguous: decode together so no char is split
            whole = self.head + self.tail
            if _fit_head(whole, self.limit) == len(whole):
                return "".join(_decode(whole))
            head = tail = whole
        else:
            head, tail = self.head, self.tail
        head_used, tail_used = _fit_head(head, self.head_cap), _fit_tail(tail, self.tail_cap)
        if head is tail:
            self.elided = max(0, len(head) - head_used - tail_used)
        else:
            self.elided += len(head) - head_used + len(tail) - tail_used
        note = f"\n[... {self.elided} bytes elided ...]\n"
        return "".join([*_decode(head[:head_used]), note, *_decode(tail[len(tail) - tail_used:])])


def _decode(raw: bytearray) -> List[str]:
    """`raw` decoded with "replace", a slice at a time, the pieces to be joined once: decoding a
    flood of undecodable bytes at once peaked at 1.7x the text's own size in the decoder."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    return [decoder.decode(raw[i:i + WIRE_SLICE], final=i + WIRE_SLICE >= len(raw))
            for i in range(0, len(raw), WIRE_SLICE)]


def wire_len(text: str) -> int:
    """Bytes `text` takes inside a JSON string as the daemon sends it (`json.dumps`, ensure_ascii);
    measured a slice at a time, so a long text is never escaped whole."""
    return sum(len(_escape(text[i:i + WIRE_SLICE])) - 2 for i in range(0, len(text), WIRE_SLICE))


def _raw_len(text: str) -> int:
    """The bytes a `surrogateescape`-decoded text came from."""
    return len(text.encode("utf-8", "surrogateescape"))


def _longest(text: str, budget: int, from_end: bool) -> str:
    """The longest head (or tail) of `text` whose wire length is within `budget` (bisection)."""
    lo, hi = 0, len(text)  # lo characters always fit, hi+1 never (the whole text did not)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if wire_len(text[len(text) - mid:] if from_end else text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return text[len(text) - lo:] if from_end else text[:lo]


def _fit_head(raw: bytearray, budget: int) -> int:
    """How many bytes of `raw`, from the start, fit `budget` on the wire.

    Measured on the text decoded a slice at a time with `surrogateescape`: one character per
    undecodable byte, so what is kept maps back to raw bytes exactly. The caller decodes those with
    "replace", which never costs more on the wire (one U+FFFD may stand for several bytes).
    """
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    used = 0
    for i in range(0, len(raw), WIRE_SLICE):
        piece = decoder.decode(raw[i:i + WIRE_SLICE], final=i + WIRE_SLICE >= len(raw))
        cost = wire_len(piece)
        if cost > budget:
            return used + _raw_len(_longest(piece, budget, from_end=False))
        used += _raw_len(piece)
        budget -= cost
    return used


def _fit_tail(raw: bytearray, budget: int) -> int:
    """How many bytes of `raw`, back from its end, fit `budget` on the wire (as `_fit_head`).

    Walks back a slice at a time; each slice starts on a character's first byte (at most 3
    continuation bytes back), so no character is split between two slices.
    """
    used, end = 0, len(raw)
    while end > 0:
        start = max(0, end - WIRE_SLICE)
        while 0 < start and end - start < WIRE_SLICE + 3 and 0x80 <= raw[start] < 0xC0:
            start -= 1
        piece = raw[start:end].decode("utf-8", "surrogateescape")
        cost = wire_len(piece)
        if cost > budget:
            return used + _raw_len(_longest(piece, budget, from_end=True))
        used += end - start
        budget -= cost
        end = start
    return used
