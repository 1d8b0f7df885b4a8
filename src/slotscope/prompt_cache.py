"""llama-server's slot choice and host prompt cache (``--cache-ram``) at b11434, over a token
model of the calls, for the what-if replay (:mod:`slotscope.whatif`).

The logs give each call's prompt length and the tokens it reused, not the tokens themselves;
what two prompts have in common is modelled from what the app log says of them
(:func:`token_model`):

* a chat turn continues its conversation's previous chat turn when that prompt and its reply
  fit in its own (a summary fold starts a new run): the earlier turns of its run are a prefix
  of its prompt (their replies are taken as not reproduced: the common prefix of such a state
  with the prompt is the earlier prompt);
* two chat turns of one user otherwise share the user's persona: the most any of the user's
  turns that continue nothing reused;
* any other two calls share a header, per pair of purposes (chat turns one purpose): the
  smaller of the two purposes' headers, each the most common count above 0 reused by the
  calls of that purpose that cannot share more (the non-chat calls, and a user's first chat
  turn).

A slot or cache state is its last call's prompt and reply (``prompt + n_gen - 1`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

SLOT_PROMPT_SIMILARITY = 0.10  # -sps default: the share of the prompt a slot must hold to be picked for it
KEEP_FOR_SAVE = 0.5  # get_available_slot: a slot picked by similarity keeping less of its tokens is saved first
KEEP_FOR_LOAD = 0.25  # server_prompt_cache::load: an entry keeping less of itself is never restored


@dataclass(frozen=True)
class Tokens:
    """The token model, one entry per workload row (see the module's docstring)."""

    prompt: np.ndarray  # prompt tokens
    run: np.ndarray  # the run of chat turns the call belongs to, -1: not a chat turn
    step: np.ndarray  # its place in the run
    user: np.ndarray  # user code, -1: none
    persona: np.ndarray  # per row: the tokens its user's chat turns share, 0: not known
    kind: np.ndarray  # header class code (chat turns one class)
    header: np.ndarray  # per header class: its header tokens


def token_model(prompt: np.ndarray, cached: np.ndarray, n_gen: np.ndarray, send: np.ndarray, group: np.ndarray,
                conv: np.ndarray, user: np.ndarray, chat: np.ndarray, purpose: np.ndarray) -> Tokens:
    """The token model of the logged calls (their logged split and order)."""
    n = len(prompt)
    # (run, step and kind are codes: int32, as the workload's)
    run = np.full(n, -1, dtype=np.int32)
    step = np.zeros(n, dtype=np.int32)
    turns = np.flatnonzero(chat & (conv >= 0))
    turns = turns[np.lexsort((send[turns], conv[turns], group[turns]))]
    # A turn goes on from the one before it: same conversation and session, and its prompt holds
    # that turn's prompt and reply (no chat turn at all: none does).
    i, j = turns[:-1], turns[1:]
    goes_on = np.zeros(len(turns), dtype=bool)
    goes_on[1:] = (conv[j] == conv[i]) & (group[j] == group[i]) & (prompt[i] + n_gen[i] <= prompt[j])
    starts = ~goes_on
    run[turns] = np.cumsum(starts) - 1
    first = np.maximum.accumulate(np.where(starts, np.arange(len(turns)), 0))
    step[turns] = np.arange(len(turns)) - first
    persona = _personas(turns[starts], cached, group, user, n)
    kind, header = _headers(cached, chat, purpose, group, user, send, turns[starts])
    return Tokens(prompt=prompt.astype(np.int64), run=run, step=step, user=user, persona=persona,
                  kind=kind.astype(np.int32), header=header)


def _personas(starts: np.ndarray, cached: np.ndarray, group: np.ndarray, user: np.ndarray, n: int) -> np.ndarray:
    """Per row: the most a chat turn of its user (same session) that continues no turn of its
    own reused (what it can only have shared with the user's other turns)."""
    out = np.zeros(n, dtype=np.int64)
    known = starts[user[starts] >= 0]
    if not len(known):
        return out
    most = pd.DataFrame({"g": group[known], "u": user[known], "c": cached[known]}).groupby(["g", "u"])["c"].max()
    rows = np.flatnonzero(user >= 0)
    got = most.reindex(pd.MultiIndex.from_arrays([group[rows], user[rows]])).to_numpy()
    out[rows] = np.nan_to_num(got.astype(float)).astype(np.int64)
    return out


def _headers(cached: np.ndarray, chat: np.ndarray, purpose: np.ndarray, group: np.ndarray, user: np.ndarray,
             send: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Header class per row and header tokens per class: the most common positive count
    reused by the calls of the class that share nothing more with any other call (calls that
    are no chat turn, and each user's first chat turn); a class without one gets the smallest
    header found (0 if none)."""
    kind, names = pd.factorize(np.where(chat, -2, purpose))  # (chat turns one class, and calls without a purpose one)
    lone = ~chat
    if len(starts):
        s = starts[np.lexsort((send[starts], user[starts], group[starts]))]
        first_of_user = np.r_[True, (user[s][1:] != user[s][:-1]) | (group[s][1:] != group[s][:-1])]
        lone[s[first_of_user | (user[s] < 0)]] = True
    header = np.full(len(names), -1, dtype=np.int64)
    seen = lone & (cached > 0)
    for k in np.unique(kind[seen]):
        header[k] = int(pd.Series(cached[seen & (kind == k)]).mode().min())
    found = header[header >= 0]
    header[header < 0] = int(found.min()) if len(found) else 0
    return kind, header


def _ints(a: np.ndarray) -> memoryview:
    return np.ascontiguousarray(a).data


class HostCache:
    """One server session's slots' tokens and its host prompt cache, in the token model: a
    slot or an entry is the row of the call whose prompt and reply it holds (-1: empty);
    ``n_gen`` is each row's tokens generated (read when a state is measured)."""

    def __init__(self, tk: Tokens, n_gen: np.ndarray, n_slots: int, limit_tokens: int) -> None:
        self.n_gen = n_gen
        # The replay asks of one row at a time, where a numpy element costs more than the
        # arithmetic done with it: the token model's arrays seen as memoryviews, whose items
        # are Python ints (a list would hold an object per row).
        self.prompt = _ints(tk.prompt)
        self.run = _ints(tk.run)
        self.step = _ints(tk.step)
        self.user = _ints(tk.user)
        self.persona = _ints(tk.persona)
        self.kind = _ints(tk.kind)  # per row: its header class
        self.header: list[int] = tk.header.tolist()  # per class: its header's tokens
        self.held = [-1] * n_slots
        # row -> its state's tokens (its call is done: they stay) and whether the header alone
        # keeps less than KEEP_FOR_LOAD of them; oldest first
        self.entries: dict[int, tuple[int, bool]] = {}
        self.limit_tokens, self.tokens = limit_tokens, 0

    def common_prefix(self, a: int, b: int) -> int:
        """Tokens of call ``b``'s prompt that call ``a``'s prompt and reply start with."""
        run_a = self.run[a]
        if run_a >= 0 and run_a == self.run[b] and self.step[a] < self.step[b]:
            return self.prompt[a]
        head = min(self.header[self.kind[a]], self.header[self.kind[b]])
        if run_a >= 0 and self.run[b] >= 0 and self.user[a] >= 0 and self.user[a] == self.user[b]:
            return max(self.persona[b], head)
        return head

    def size(self, a: int) -> int:
        """Tokens of the state of row ``a``: its prompt and reply but the last token."""
        return self.prompt[a] + max(int(self.n_gen[a]), 1) - 1

    def lcp(self, a: int, b: int) -> int:
        """Common prefix of the state of row ``a`` (-1: empty) with the prompt of row ``b``."""
        if a < 0:
            return 0
        return min(self.common_prefix(a, b), self.size(a), self.prompt[b])

    def pick(self, b: int, idle: list[int], used: list[float]) -> int:
        """get_available_slot (server-context.cpp): the idle slot whose tokens are the largest
        share of the prompt, above :data:`SLOT_PROMPT_SIMILARITY`, else the least recently
        released (ties: the highest id). A slot picked the second way, or keeping less than
        :data:`KEEP_FOR_SAVE` of its tokens, is saved to the cache and reloaded for ``b``."""
        p = max(self.prompt[b], 1)
        best, pick, n_pick = SLOT_PROMPT_SIMILARITY, -1, 0
        for s in idle:
            a = self.held[s]
            if a >= 0:
                n = self.lcp(a, b)
                if n / p > best:
                    best, pick, n_pick = n / p, s, n
        if pick >= 0 and n_pick / self.size(self.held[pick]) >= KEEP_FOR_SAVE:
            return pick
        s = pick if pick >= 0 else min(idle, key=lambda s: (used[s], -s))
        self.save(s)
        self.load(s, b)
        return s

    def save(self, s: int) -> None:
        """server_prompt_cache::alloc: slot ``s``'s state appended unless the cache holds it;
        then (update) the oldest entries go while the cache holds more than its token limit.
        That limit is n_ctx, raised where --cache-ram's 8 GiB hold more tokens of the model's
        state; the logs do not say how many bytes a token takes, so the replay keeps n_ctx,
        the floor (a model of real size reaches it; the captures' tiny one would keep more)."""
        a = self.held[s]
        if a >= 0 and a not in self.entries:
            size = self.size(a)
            self.entries[a] = size, 4 * self.header[self.kind[a]] < size
            self.tokens += size
            while len(self.entries) > 1 and self.tokens > self.limit_tokens:
                self.tokens -= self.entries.pop(next(iter(self.entries)))[0]

    def load(self, s: int, b: int) -> None:
        """server_prompt_cache::load: oldest first, the entry that beats the slot's own tokens
        (and every entry before it) on both the share of itself kept and the share of the
        prompt; entries keeping less than :data:`KEEP_FOR_LOAD` are skipped. The one found
        moves into the slot."""
        a, p = self.held[s], max(self.prompt[b], 1)
        n = self.lcp(a, b)
        keep = n / self.size(a) if a >= 0 else -1.0
        sim = n / p
        best = -1
        run_b, user_b = self.run[b], self.user[b]
        for e, (size, kin_only) in self.entries.items():
            # An entry shares only a header with a prompt that is neither a later turn of its run
            # nor its user's (common_prefix): one whose header keeps too little of it is skipped
            # unasked, as most are, each being another user's.
            if kin_only and (run_b < 0 or (self.run[e] != run_b and self.user[e] != user_b)):
                continue
            n = min(self.common_prefix(e, b), size, self.prompt[b])
            k_e, s_e = n / size, n / p
            if k_e >= KEEP_FOR_LOAD and keep < k_e and sim < s_e:
                keep, sim, best = k_e, s_e, e
        if best >= 0:
            self.held[s] = best
            self.tokens -= self.entries.pop(best)[0]

    def launched(self, s: int, b: int, idle: list[int]) -> None:
        """Call ``b`` launched on slot ``s`` (its tokens from now on); every other idle slot is
        saved (process_single_task, ``--cache-idle-slots``)."""
        self.held[s] = b
        for k in idle:
            if k != s:
                self.save(k)

    def reused(self, s: int, b: int) -> int:
        """Prompt tokens of ``b`` that slot ``s`` holds: the common prefix, but never the whole
        prompt (the last token is always processed)."""
        return max(min(self.lcp(self.held[s], b), self.prompt[b] - 1), 0)
