"""The one JSON Lines writer: how every output line (predictions, extractions, Ray parts) is rendered.

A line is ``json.dumps(document, ensure_ascii=False)`` plus ``"\\n"``: non-ASCII text is written as
UTF-8, not as ``\\u`` escapes, so a line reads back as the record's own text. Files are opened
UTF-8 by their callers.
"""

from __future__ import annotations

import json
from typing import IO


def json_line(document: object) -> str:
    """One JSON line's text, without its newline."""
    return json.dumps(document, ensure_ascii=False)


def write_line(sink: IO[str], document: object) -> None:
    """Write ``document`` to ``sink`` as one JSON line (not flushed)."""
    sink.write(json_line(document) + "\n")
