"""Counting a JSON body's values and nesting on its raw bytes, before `json.loads` builds them.

Why: `json.loads` is one C call that holds the interpreter lock for as long as it builds objects
(~0.1-0.2 µs each): an 8 MB body of 4M numbers or 240k messages stalls every thread of the process,
the event loop included, for 0.4-0.8 s, whichever thread parses it. So a body's size in values is
bounded before it is parsed (`inference.limits.check_json_size`).

How: every value but the first follows a `,` or a `:` or opens with `[` or `{`, so those bytes
outside strings count the values (a container's closing bracket builds nothing). Four
`bytes.count` calls over the whole body settle the common case at once: if even counting the bytes
inside strings stays under the limit, the body is small enough. Otherwise the body is scanned
`WINDOW` bytes at a time: a window without a string (a run of numbers) is counted with
`bytes.count`, one with strings is walked token by token with one regex (a whole string is one
token). Every step is a C call over a bounded span, so a worker thread yields the lock between
steps (the event loop answers within milliseconds), and the scan stops as soon as the count passes
the limit: a hostile body is refused after its first windows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ITEM_BYTES = (b",", b":", b"[", b"{")
WINDOW = 1 << 16  # most bytes one step scans (~1-5 ms holding the lock); >= 2, so an escape fits
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+'  # a string's quote and content (unrolled, possessive: no backtracking)
_TOKEN = re.compile(_STRING + rb'"|[",:\[{\]}]', re.DOTALL)  # a whole string, a quote opening a cut one, a byte
_STRING_BODY = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)  # a string's content, up to its closing quote
_QUOTE = ord('"')
_OPENING, _CLOSING = b"[{", b"]}"


def scan_json(raw: bytes, max_items: int, max_depth: int) -> tuple[int, bool]:
    """(items, too_deep) of a raw JSON body: its `,` `:` `[` `{` bytes outside strings (about one
    per value `json.loads` would build), and whether its nesting passes `max_depth`. The scan stops
    once either passes its max. When the first count settles the items, the nesting is left to the
    parser (too_deep False): few values cannot nest deep enough to cost anything.
    """
    total = sum(raw.count(c) for c in ITEM_BYTES)
    if total <= max_items:  # even counting the bytes inside strings: few enough
        return total, False
    scan = _Scan(raw, max_items, max_depth)
    scan.run()
    return scan.items, scan.depth > max_depth


@dataclass
class _Scan:
    """One scan of a body past the first count: items and nesting so far."""

    raw: bytes
    max_items: int
    max_depth: int
    items: int = 0
    depth: int = 0

    @property
    def over(self) -> bool:
        return self.items > self.max_items or self.depth > self.max_depth

    def run(self) -> None:
        pos, end = 0, len(self.raw)
        while pos < end and not self.over:
            window = min(pos + WINDOW, end)
            if self.raw.find(b'"', pos, window) < 0:
                pos = self._count(pos, window)
            else:
                pos = self._walk(pos, window)

    def _count(self, pos: int, window: int) -> int:
        """A span without strings (a run of numbers, say), counted with `bytes.count`; its end."""
        raw = self.raw
        opens = raw.count(b"[", pos, window) + raw.count(b"{", pos, window)
        if self.depth + opens > self.max_depth:  # the nesting might pass the limit here: order matters
            return self._walk(pos, window)
        self.items += sum(raw.count(c, pos, window) for c in ITEM_BYTES)
        self.depth += opens - raw.count(b"]", pos, window) - raw.count(b"}", pos, window)
        return window

    def _walk(self, pos: int, window: int) -> int:
        """A span token by token (strings whole), until it ends or a max is passed; where to go on."""
        for token in _TOKEN.finditer(self.raw, pos, window):
            byte = self.raw[token.start()]
            if byte == _QUOTE:
                if token.end() - token.start() == 1:  # a string the window cuts: skip it whole
                    return _after_string(self.raw, token.end())
            elif byte in _CLOSING:
                self.depth -= 1
            else:
                self.items += 1
                self.depth += byte in _OPENING
                if self.over:
                    return token.end()
        return window


def _after_string(raw: bytes, pos: int) -> int:
    """Where the string whose content starts at `pos` ends (after its closing quote), window by
    window; the body's end if it never closes (json.loads names that error)."""
    end = len(raw)
    while pos < end:
        window = min(pos + WINDOW, end)
        start, pos = pos, _STRING_BODY.match(raw, pos, window).end()
        if pos < window and raw[pos] == _QUOTE:
            return pos + 1
        if pos == start:  # a lone backslash as the body's last byte
            return end
    return end
