"""What a LoRA change costs a short prefill: right after a switch vs after the same setting.

A task *follows a switch* when the task launched before it on the same server session had a
different LoRA label (``none`` = no LoRA); it *follows the same setting* when that task had the
same label. Only short prompts count (fewer than :data:`SHORT_PROMPT_TOKENS` new tokens), so
that the prefill is small next to a switch. Tasks whose own or previous label is unknown (no
app log line, or the first task of a session) are left out.

``prompt eval time`` of a task on a busy server is mostly other slots' work in the same passes,
so beside all such tasks the table gives the ones whose prefill ran with no other task holding a
slot (``alone_*``): the field report's measurement ("while the production model was idle").
"""

from __future__ import annotations

import pandas as pd

from ..dataset import Dataset, task_view, tasks_of
from . import Options, register
from .context import SESSION, tasks_during
from .turns import needs_app_log

SHORT_PROMPT_TOKENS = 1_000
COLUMNS = [
    "setting", "change", "lora", "count", "prefill_median_ms", "alone_count", "alone_prefill_median_ms",
    "few_samples",
]


@register("lora-switch")
def lora_switch(ds: Dataset, opts: Options) -> pd.DataFrame:
    """Median prefill time of short prompts right after a LoRA change and after the same setting, by target setting."""
    if ds.matches is None:
        return needs_app_log(COLUMNS)
    # Only the columns read here are read and sorted (the task view has ~50).
    tv = task_view(ds, SESSION + ["launch_s", "task_id", "lora", "prompt_tokens_new", "prompt_eval_ms",
                                  "prefill_start_s", "first_token_s"])
    tv = tv.sort_values(SESSION + ["launch_s", "task_id"], kind="stable").reset_index(drop=True)
    tv["lora"] = tv["lora"].astype("string")
    tv["prev_lora"] = tv.groupby(SESSION, sort=False, observed=True)["lora"].shift(1)
    tv["others"] = tasks_during(tasks_of(ds, SESSION + ["launch_s", "release_s"]), tv, "prefill_start_s", "first_token_s") - 1
    short = (tv["prompt_tokens_new"] < SHORT_PROMPT_TOKENS).fillna(False) & tv["prompt_eval_ms"].notna()
    known = tv["lora"].notna() & tv["prev_lora"].notna()
    t = tv.loc[(short & known).to_numpy()].copy()
    t["change"] = (t["lora"] != t["prev_lora"]).map({True: "to", False: "same"})
    t["alone_ms"] = t["prompt_eval_ms"].where(t["others"] <= 0)
    g = t.groupby(["change", "lora"], sort=True, observed=True)
    table = pd.DataFrame({
        "count": g["prompt_eval_ms"].count(),
        "prefill_median_ms": g["prompt_eval_ms"].median(),
        "alone_count": g["alone_ms"].count(),
        "alone_prefill_median_ms": g["alone_ms"].median(),
    }).reset_index()
    # Switches first, then the same-setting baselines.
    table = table.sort_values(["change", "lora"], ascending=[False, True], kind="stable").reset_index(drop=True)
    table["setting"] = table["change"] + " " + table["lora"]
    table[["count", "alone_count"]] = table[["count", "alone_count"]].astype("int64")
    table[["prefill_median_ms", "alone_prefill_median_ms"]] = table[["prefill_median_ms", "alone_prefill_median_ms"]].round(1)
    table["few_samples"] = table["count"] < opts.min_samples
    return table[COLUMNS]
