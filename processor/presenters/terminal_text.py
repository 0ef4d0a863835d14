"""Strings from the wire made safe to print: no terminal control sequence, no markup.

Run ids, strategies, host names, device names and issue texts come from senders
nobody vetted. Printed raw, an OSC sequence retitles the terminal (or, on some,
writes the clipboard), a CSI clears the screen or moves the cursor, a C1 byte
does the same on terminals that honour 8-bit controls, and a bidi override
makes a name read differently from what it is. Rich passes all of these through.

Every presenter (the live view, `traceml top`, `traceml summary` and its
`--list`, the summary card, `traceml compare`) passes such strings through
`printable` before they reach a terminal, and hands them to Rich as `Text`
(never as markup), so `[bold red]` in a run id is shown as typed. Storage and
`final_summary.json` keep the true string (JSON escapes what it must).
"""
from __future__ import annotations

import unicodedata

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Controls (C0, DEL, C1), format characters (bidi overrides and isolates, zero-width
characters), lone surrogates (unencodable: printing one would raise) and the line and
paragraph separators. Spaces, letters, marks and symbols of any script stay."""


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(value: object, *, keep_newlines: bool = False) -> str:
    """`value` as text a terminal shows literally: each control or format character
    becomes its visible `\\xNN` / `\\uNNNN` escape (so `run\\x1b[2J` reads as
    typed, and two ids that differ only in a control character still look different).

    `keep_newlines` keeps `\\n` for multi-line text such as the summary card; tabs
    and carriage returns are escaped either way.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # the common case: one C-level scan
        return text
    return "".join(
        char if (char == "\n" and keep_newlines) or unicodedata.category(char) not in _ESCAPED_CATEGORIES
        else _escape(char)
        for char in text
    )


def printable_text(value: object, style: str = ""):
    """`printable(value)` as a Rich `Text`: never parsed as markup (titles, table cells)."""
    from rich.text import Text

    return Text(printable(value), style=style)


__all__ = ["printable", "printable_text"]
