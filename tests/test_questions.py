"""analyze.answer over many parts, answered by worker processes: a question that fails on one
part gives its tables a note (or, strict, raises), and the other questions go on."""

from __future__ import annotations

import pandas as pd
import pytest

from slotscope import analyze
from slotscope.analyze.questions import Question
from slotscope.dataset import load
from slotscope.periods import Part

from .conftest import REAL


def _tasks_per_part(part: Part, opts: analyze.Options) -> int:
    return int(part.counted.sum())


def _counted(answers: list[int], opts: analyze.Options, ds: object) -> dict[str, pd.DataFrame]:
    return {"counted": pd.DataFrame({"tasks": [sum(answers)], "parts": [len(answers)]})}


def _fails_on_the_third(part: Part, opts: analyze.Options) -> int:
    if part.index == 2:
        raise ValueError(f"part {part.index} is odd")
    return 1


def _parts(answers: list[int], opts: analyze.Options, ds: object) -> dict[str, pd.DataFrame]:
    return {"failing": pd.DataFrame({"parts": [len(answers)]})}


COUNTED = Question(("counted",), _tasks_per_part, _counted)
FAILING = Question(("failing",), _fails_on_the_third, _parts)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_failing_question_is_noted_and_the_others_go_on(monkeypatch: pytest.MonkeyPatch, jobs: str) -> None:
    monkeypatch.setenv("SLOTSCOPE_JOBS", jobs)
    ds = load([REAL / "before" / "logs"])
    out = analyze.answer([FAILING, COUNTED], ds, analyze.Options(), part_tasks=8, strict=False)
    assert out["counted"]["tasks"].iloc[0] == len(ds.server.tasks)  # (every task counted once, over the parts)
    assert out["counted"]["parts"].iloc[0] > 3
    assert out["failing"]["note"].iloc[0] == "could not compute failing: ValueError: part 2 is odd"
    with pytest.raises(ValueError, match="part 2 is odd"):
        analyze.answer([COUNTED, FAILING], ds, analyze.Options(), part_tasks=8, strict=True)
