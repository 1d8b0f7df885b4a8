"""What a LoRA change costs a short prefill: right after a switch vs after the same setting.

A task *follows a switch* when the task launched before it on the same server session had a
different LoRA label (``none`` = no LoRA); it *follows the same setting* when that task had the
same label. Only short prompts count (fewer than :data:`SHORT_PROMPT_TOKENS` new tokens), so
that the prefill is small next to a switch. Tasks whose own or previous label is unknown (no
app log line, or the first task of a session) are left out.

``prompt eval time`` of a task on a busy server is mostly other slots' work in the same passes,
so beside all such tasks the table gives the ones whose prefill ran with no other task holding a
slot (``alone_*``): the field report's measurement ("while the production model was idle").
The slots held are counted in each busy period (:mod:`slotscope.periods`); the switches, which
are mostly from one busy period to the next, over the per-task rows of every period.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..dataset import Dataset, task_view
from ..periods import Part
from ..timeline import GROUP, floats, key_codes
from .questions import Options, Question, ask
from .context import count_during
from .turns import needs_app_log

SHORT_PROMPT_TOKENS = 1_000
# What the merge reads of each task: its session and launch (to find the task launched before
# it), its label, its row in the task view, and a short prefill's time (NaN: none).
OWN = GROUP + ["launch_s", "task_id", "lora", "row", "prefill_ms"]
VIEW_COLUMNS = OWN[:-2] + ["prompt_tokens_new", "prompt_eval_ms"]
COLUMNS = [
    "setting", "change", "lora", "count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms",
    "few_samples",
]


def _holding(tasks: pd.DataFrame, among: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """For each of the ``windows`` (rows of ``tasks``: their prefill, from its start to the
    first token), how many of the tasks ``among`` (a mask) of its session held a slot during
    it: launched before the window ends, minus released before it starts (never released:
    held to the end)."""
    known = tasks[GROUP].notna().all(axis=1).to_numpy()
    code = key_codes([tasks], GROUP)[0]
    held = among & known
    count = count_during(code[held], floats(tasks["launch_s"])[held], floats(tasks["release_s"])[held], code[windows],
                         floats(tasks["prefill_start_s"])[windows], floats(tasks["first_token_s"])[windows])
    return np.where(known[windows], count, 0)


def per_part(part: Part, opts: Options) -> pd.DataFrame:
    """For every short prefill in the part (``row`` in the task view), how many tasks held a
    slot during it (``held``), of those this part counts the pair of."""
    t = part.tasks
    counted = part.counted
    windows = np.flatnonzero(_short(t))
    # A task running across a cut of a long period is in both parts, as context in the later.
    # A prefill is counted with the tasks the part counts, and in the part that counts it also
    # with the context: so each pair of tasks is counted in one part.
    held = np.where(counted[windows], _holding(t, np.ones(len(t), dtype=bool), windows), _holding(t, counted, windows))
    return pd.DataFrame({"row": part.rows[windows], "held": held})


def _short(t: pd.DataFrame) -> np.ndarray:
    """Which tasks had a short prefill, with its time."""
    return ((t["prompt_tokens_new"] < SHORT_PROMPT_TOKENS).fillna(False) & t["prompt_eval_ms"].notna()).to_numpy()


def merge(answers: list[pd.DataFrame], opts: Options, ds: Dataset) -> dict[str, pd.DataFrame]:
    """The table: each short prefill after the task launched before it in its session, by
    whether that task's LoRA label differs, and the label."""
    if ds.matches is None:
        return {"lora-switch": needs_app_log(COLUMNS)}
    # (which task was launched before which is a question of each session's sequence of tasks)
    tv = task_view(ds, VIEW_COLUMNS)
    short = _short(tv)
    tv = tv[OWN[:-2]].assign(row=np.arange(len(tv)), prefill_ms=np.where(short, floats(tv["prompt_eval_ms"]), np.nan))
    held = pd.concat(answers or [pd.DataFrame(columns=["row", "held"])]).groupby("row")["held"].sum()
    tv = tv.sort_values(GROUP + ["launch_s", "task_id", "row"], kind="stable")
    tv["lora"] = tv["lora"].astype("string")
    tv["prev_lora"] = tv.groupby(GROUP, sort=False, observed=True)["lora"].shift(1)
    t = tv.loc[(tv["prefill_ms"].notna() & tv["lora"].notna() & tv["prev_lora"].notna()).to_numpy()]
    t = t.assign(change=(t["lora"] != t["prev_lora"]).map({True: "to", False: "same"}),
                 alone_ms=t["prefill_ms"].where((held.reindex(t["row"]).to_numpy() - 1 <= 0)))
    g = t.groupby(["change", "lora"], sort=True)
    table = pd.DataFrame({
        "count": g["prefill_ms"].count(),
        "prefill_median_ms": g["prefill_ms"].median(),
        "alone_count": g["alone_ms"].count(),
        "alone_prefill_median_ms": g["alone_ms"].median(),
    }).reset_index()
    # Switches first, then the same-setting baselines.
    table = table.sort_values(["change", "lora"], ascending=[False, True], kind="stable").reset_index(drop=True)
    table["setting"] = table["change"] + " " + table["lora"]
    table[["count", "alone_count"]] = table[["count", "alone_count"]].astype("int64")
    table[["prefill_median_ms", "alone_prefill_median_ms"]] = table[["prefill_median_ms", "alone_prefill_median_ms"]].round(1)
    table["few_samples"] = table["count"] < opts.min_samples
    return {"lora-switch": table[COLUMNS]}


QUESTION = ask(Question(("lora-switch",), per_part, merge))
