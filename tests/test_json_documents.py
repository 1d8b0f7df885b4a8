"""JSON documents read a record at a time: the same records and lines in blocks of any size."""

from __future__ import annotations

import json

import pytest

from slotscope.json_documents import DocumentError, Records, is_document

from .conftest import FORMATS, REAL


def test_log_lines_that_start_with_a_bracket_are_no_document() -> None:
    """A colour code that lost its ESC (`[34m`), a router's `[8080]`, LM Studio's bracketed
    stamp: real first lines that start with `[` and are log lines, not a JSON array."""
    for name in ("ansi_lost_esc.log", "router.log", "lmstudio.log"):
        first = (FORMATS / name).read_text().lstrip()[:200]
        assert not is_document(first), name
    assert is_document("[\n  {\"id\": 1}")
    assert is_document("\ufeff[{\"id\": 1}]")
    assert is_document("{\n  \"id\": 1\n}\n")
    assert not is_document((REAL / "before" / "logs" / "app.jsonl").read_text()[:500])


@pytest.mark.parametrize("size", [1, 7, 4096, 1 << 20])
def test_records_and_lines_do_not_depend_on_block_size(size: int) -> None:
    records = [json.loads(line) for line in (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()]
    records[0]["user"] = "u\u00e9\U0001f600"  # (a character cut across blocks)
    for text in (json.dumps(records, indent=2), json.dumps(records),
                 "".join(json.dumps(r, indent=1, ensure_ascii=False) + "\n" for r in records)):
        data = text.encode()
        values = Records([data[i:i + size] for i in range(0, len(data), size)], json.JSONDecoder().raw_decode)
        got = list(values)
        assert [v for _, v, _ in got] == records and values.cut_at is None
        assert values.lines == len(text.splitlines())
        lines = text.splitlines()
        assert all(t.split("\n")[0] in lines[n - 1] for n, _, t in got)  # (each on the line it starts on)


def test_a_bad_record_names_its_line_and_a_cut_end_is_no_error() -> None:
    text = json.dumps([json.loads(line) for line in (REAL / "before" / "logs" / "app.jsonl").read_text().splitlines()],
                      indent=2)
    bad = text.replace('"c-00004",', '"c-00004"', 1)
    at = bad.splitlines().index('    "id": "c-00004"') + 2
    with pytest.raises(DocumentError) as e:
        list(Records([bad.encode()], json.JSONDecoder().raw_decode))
    assert (e.value.line, e.value.reason) == (at, "invalid JSON: Expecting ',' delimiter")
    cut = text[: text.index('"c-00004"')]
    values = Records([cut.encode()], json.JSONDecoder().raw_decode)
    assert len(list(values)) == 1 and values.cut_at == cut.count("\n")
