"""Text from a network peer, made safe to show on a terminal.

Whatever an endpoint sends (metric and label names, label values, an HTTP reason phrase, a
``Location``, error text) reaches the screen only through :func:`clean`. A terminal obeys
control characters (``\\x1b]0;...\\x07`` sets the window title, ``\\x1b[2J`` clears it, and
``\\x9b`` is a one-byte CSI on many terminals), a newline starts a fake row, and bidi and
zero-width code points make text read differently from what it is. Each of those is shown
as a visible escape instead (``\\x1b``, ``\\u202e``); everything else passes unchanged.
"""

from __future__ import annotations

import re

# Code points that Unicode marks Default_Ignorable (rendered as nothing) although their
# category is a printable one, so ``str.isprintable`` lets them through: combining grapheme
# joiner, Hangul fillers, Khmer inherent vowels, Mongolian variation selectors, variation
# selectors. The other default-ignorables are in categories Cf or Cn, escaped anyway.
_INVISIBLE = frozenset([0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x3164, 0xFFA0,
                        *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)])

_PLAIN_ASCII = re.compile(r"[\x20-\x7e]*")


def safe(ch: str) -> bool:
    """Whether one code point may reach a terminal as itself: a printable character in
    Python's sense (not Cc, Cf, Cs, Co, Cn, Zl, Zp, nor a space other than U+0020) that is
    not invisible."""
    return ch.isprintable() and ord(ch) not in _INVISIBLE


def escape(ch: str) -> str:
    """``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``: the code point spelled in printable ASCII."""
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def clean(text: str) -> str:
    """``text`` with every code point that is not :func:`safe` replaced by its escape.
    Idempotent: an escape is plain ASCII, so cleaning twice changes nothing."""
    if _PLAIN_ASCII.fullmatch(text):  # the common case: names and numbers
        return text
    return "".join(ch if safe(ch) else escape(ch) for ch in text)
