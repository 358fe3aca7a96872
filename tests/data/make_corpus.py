"""Writes the bad-input corpus next to this file. Run it to regenerate: python tests/data/make_corpus.py

Each case and its expected outcome is listed in README.md here; tests/io/test_io_bad_inputs.py checks them.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
HUGE = ("my invoice shows a charge I do not recognise " * 2300)[:100_000]  # 100,000 characters


def _line(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8") + b"\n"


def jsonl() -> bytes:
    return b"".join([
        _line({"id": "ok-1", "text": "I was charged twice, please refund me"}),
        _line({"id": "empty", "text": ""}),
        _line({"id": "spaces", "text": "  \t \n "}),
        _line({"id": "huge", "text": HUGE}),
        b'{"id": "bad-utf8", "text": "caf\xe9 cr\xff\xfesh"}\n',  # Latin-1 bytes, not UTF-8
        _line({"id": "no-text", "body": "the text is under another key"}),
        _line({"id": "ok-1", "text": "a second record with the first one's id"}),
        _line({"id": "number", "text": 12345}),
        _line({"id": "list", "text": ["refund", "me"]}),
        _line({"id": "bool", "text": True}),
        _line({"id": "null", "text": None}),
        _line({"id": "object", "text": {"body": "nested"}}),
        _line({"id": 7.5, "text": "an id that is a float"}),
        _line({"id": ["x"], "text": "an id that is a list"}),
        b'{"id": "broken", "text": "the closing quote is missing}\n',
        b"[1, 2, 3]\n",
        b'{"id": "surrogate", "text": "\\ud800 is half of a pair"}\n',
        b"\n",
        _line({"id": "ok-2", "text": "The app crashes when I open settings"}),
        _line({"id": "unicode", "text": "日本語のチケット: l'été, naïve café"}),
        b'{"id": "ok-last", "text": "I cannot log in"}',  # no newline at the end of the file
    ])


def csv_bytes() -> bytes:
    return b"".join([
        "\ufeffid,text,note\r\n".encode("utf-8"),  # a BOM, as spreadsheets write
        b"ok-1,I was charged twice,plain\r\n",
        b'quoted,"He wrote ""refund me""\nthen, on a new line, ""now""",newlines and quotes\r\n',
        b"empty,,empty text\r\n",
        b"bad-utf8,caf\xe9,not UTF-8\r\n",
        b"too-many,a,b,c\r\n",
        b"too-few,only the text\r\n",
        b"quoted,same id again,duplicate\r\n",
        b"\r\n",
        b'commas,"billing, refund, invoice",commas inside quotes\r\n',
        b"ok-2,The app crashes on start,last row\r\n",
    ])


if __name__ == "__main__":
    (HERE / "bad_records.jsonl").write_bytes(jsonl())
    (HERE / "bad_records.csv").write_bytes(csv_bytes())
    print("wrote", HERE / "bad_records.jsonl", HERE / "bad_records.csv")
