"""The host prompt cache's rules on a hand-made token model (one user, two runs of turns)."""

from __future__ import annotations

import dataclasses

import numpy as np

from slotscope.prompt_cache import HostCache, Tokens


def _tokens() -> Tokens:
    # Rows 0-2: turns of one run; row 3: the same user's next conversation (persona 300).
    return Tokens(prompt=np.array([1000, 1300, 1600, 900]), run=np.array([0, 0, 0, 1]), step=np.array([0, 1, 2, 0]),
                  user=np.zeros(4, dtype=np.int64), persona=np.full(4, 300), kind=np.zeros(4, dtype=np.int64),
                  header=np.array([80]))


def test_load_takes_the_oldest_entry_no_later_one_beats_on_both() -> None:
    # Turn 2 on an empty slot: turn 0's state keeps 1000 of its 1199 tokens (0.83), turn 1's
    # 1300 of 1699 (0.77): turn 1 covers more of the prompt but keeps less of itself.
    hc = HostCache(_tokens(), np.array([200, 400, 1, 1]), 2, 1 << 20)
    hc.held = [0, 1]
    hc.save(0), hc.save(1), hc.save(0)
    assert list(hc.entries) == [0, 1]
    hc.held = [-1, -1]
    hc.load(0, 2)
    assert hc.held[0] == 0 and list(hc.entries) == [1] and hc.reused(0, 2) == 1000


def test_persona_match_against_a_long_entry_is_skipped() -> None:
    # The next conversation shares 300 tokens with entries of 1699 and 1399: under a quarter.
    hc = HostCache(_tokens(), np.array([400, 400, 1, 1]), 1, 1 << 20)
    for a in (1, 0):
        hc.held = [a]
        hc.save(0)
    hc.held = [-1]
    hc.load(0, 3)
    assert hc.held[0] == -1 and hc.reused(0, 3) == 0


def test_lru_pick_saves_the_slot_and_similarity_keeps_it() -> None:
    hc = HostCache(_tokens(), np.array([200, 400, 1, 1]), 2, 1 << 20)
    hc.held = [3, 1]
    # Turn 2: slot 1 holds turn 1 (1300 of 1600 > 0.1, keeping 0.77 of itself): no save.
    assert hc.pick(2, [0, 1], [5.0, 1.0]) == 1 and not hc.entries
    # Turn 0: slot 0's other conversation shares the persona (300 of 1000 > 0.1) but keeps
    # only 0.33 of itself: saved, and nothing in the cache beats it on both.
    assert hc.pick(0, [0, 1], [5.0, 1.0]) == 0 and list(hc.entries) == [3] and hc.held[0] == 3
    # With no similar slot (the header alone, 80 of 1000), the least recently released one
    # (slot 1) is saved and reloaded.
    tk = dataclasses.replace(_tokens(), persona=np.zeros(4, dtype=np.int64))
    hc = HostCache(tk, np.array([200, 400, 1, 1]), 2, 1 << 20)
    hc.held = [2, 1]
    assert hc.pick(3, [0, 1], [5.0, 1.0]) == 1 and list(hc.entries) == [1]


def test_the_oldest_entries_go_past_the_token_limit() -> None:
    """server_prompt_cache::update: past its token limit the cache drops its oldest entries (a
    replay of a day's log would otherwise scan every state it ever saved at each load)."""
    n_gen = np.array([200, 400, 1, 1])
    sizes = [HostCache(_tokens(), n_gen, 1, 1 << 20).size(a) for a in range(4)]
    hc = HostCache(_tokens(), n_gen, 1, sizes[1] + sizes[2])
    for a in (0, 1, 2):
        hc.held = [a]
        hc.save(0)
    assert list(hc.entries) == [1, 2] and hc.tokens == sizes[1] + sizes[2]
