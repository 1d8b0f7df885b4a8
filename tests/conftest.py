"""Shared fixtures: paths to the real captured logs and the derived format variants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import settings

# CI must say the same of the same commit: the property tests draw the same cases every run.
# `pytest --hypothesis-profile=explore` draws new ones, to look for bugs (and keep each one
# found as an @example).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent
REAL = ROOT / "fixtures" / "real"
FORMATS = ROOT / "fixtures" / "formats"
EXCERPTS = ROOT / "fixtures" / "excerpts"  # real vLLM and Ollama lines from public threads
OLLAMA = ROOT / "fixtures" / "ollama"  # Ollama logs built from the real captures
SCENARIOS = ["before", "after", "b2048-unified", "restart", "wallclock"]


def load_truth(scenario: str) -> list[dict]:
    """The client-side ground truth of one real scenario (one record per call)."""
    return [json.loads(line) for line in (REAL / scenario / "truth.jsonl").read_text().splitlines() if line.strip()]


def load_meta(scenario: str) -> dict:
    return json.loads((REAL / scenario / "meta.json").read_text())


@pytest.fixture(autouse=True)
def _pinned_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("TERM", "dumb")
