"""3-6 plain sentences generated from the other tables, each with its numbers and counts.

A statement is made only where the data support it: a class with fewer than
``opts.min_samples`` samples is mentioned as such, never stated as a finding.
"""

from __future__ import annotations

import pandas as pd

from ..dataset import Dataset
from .questions import Options, percent

FINDING_COLUMNS = ["finding", "table", "samples", "supported"]


def _row(df: pd.DataFrame | None, col: str, value: str) -> pd.Series | None:
    if df is None or col not in df.columns:
        return None
    hit = df[df[col] == value]
    return None if hit.empty else hit.iloc[0]


def _num(x: object) -> float | None:
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return None if v != v else v


Finding = dict[str, object]


def _finding(text: str, table: str, samples: int, supported: bool) -> Finding:
    return {"finding": text, "table": table, "samples": samples, "supported": supported}


def _baseline(stalls: pd.DataFrame | None, opts: Options) -> pd.Series | None:
    """The stalls class to compare against: running alone, else generation only, with enough samples."""
    for cls in ("alone", "generation_only"):
        r = _row(stalls, "class", cls)
        if r is not None and (_num(r.get("samples")) or 0) >= opts.min_samples:
            return r
    return None


def _long_prefill_stall(lp: pd.Series, base: pd.Series, opts: Options) -> list[Finding]:
    """Generation during another slot's long prefill, against the baseline."""
    n_lp = int(_num(lp["samples"]) or 0)
    v_lp, v_base = _num(lp["median_tg_3s_tps"]), _num(base["median_tg_3s_tps"])
    if v_lp is None or not v_base:
        return []
    k = f"≥{opts.long_prefill_tokens / 1000:g}K"
    how = base["class"].replace("_", " ")
    if n_lp >= opts.min_samples:
        return [_finding(f"Generation fell to {v_lp:.2f} tok/s (median of {n_lp} stretches) while another slot prefilled "
                         f"{k} new tokens, against {v_base:.1f} tok/s when running {how} "
                         f"({int(base['samples'])} stretches): {v_base / max(v_lp, 1e-9):.0f}x slower.", "stalls", n_lp, True)]
    if n_lp > 0:
        return [_finding(f"Only {n_lp} generation stretch(es) overlapped another slot's {k} prefill "
                         f"(median {v_lp:.2f} tok/s vs {v_base:.1f} tok/s {how}): too few "
                         f"(< {opts.min_samples}) to state as a finding.", "stalls", n_lp, False)]
    return []


def _short_prefill_stall(stalls: pd.DataFrame, lp: pd.Series, base: pd.Series, opts: Options) -> list[Finding]:
    """Generation during another slot's shorter prefill, where the long prefills say too little."""
    v_lp, v_base = _num(lp["median_tg_3s_tps"]), _num(base["median_tg_3s_tps"])
    n_lp = int(_num(lp["samples"]) or 0)
    op = _row(stalls, "class", "other_prefill")
    v_op = _num(op["median_tg_3s_tps"]) if op is not None else None
    n_op = int(_num(op["samples"]) or 0) if op is not None else 0
    if (v_op is None or not v_base or n_op < opts.min_samples or v_op >= v_base / 5
            or (v_lp is not None and n_lp >= opts.min_samples)):
        return []
    return [_finding(f"Generation fell to {v_op:.2f} tok/s (median of {n_op} stretches) while another slot prefilled a "
                     f"shorter prompt (under {opts.long_prefill_tokens / 1000:g}K new tokens), against {v_base:.1f} tok/s "
                     f"{base['class'].replace('_', ' ')}: a generating slot gets one token per batch pass.",
                     "stalls", n_op, True)]


def _stalls(tables: dict[str, pd.DataFrame], ds: Dataset, opts: Options) -> list[Finding]:
    stalls = tables.get("stalls")
    lp, base = _row(stalls, "class", "long_prefill"), _baseline(stalls, opts)
    if stalls is None or lp is None or base is None:
        return []
    return _long_prefill_stall(lp, base, opts) + _short_prefill_stall(stalls, lp, base, opts)


def _waits(tables: dict[str, pd.DataFrame], ds: Dataset, opts: Options) -> list[Finding]:
    """Waits before prefill behind another LoRA setting, or that there were none."""
    waits = tables.get("waits")
    if waits is None or "cause" not in waits.columns:
        return []
    dl = _row(waits, "cause", "different_lora")
    total = waits[waits["cause"].isin(["different_lora", "same_lora", "nothing"])]
    n_all = int(pd.to_numeric(total["count"], errors="coerce").fillna(0).sum()) if len(total) else 0
    if dl is not None and (_num(dl["count"]) or 0) > 0:
        n = int(dl["count"])
        text = (f"{n} of {n_all} waits of ≥{opts.wait_threshold_s:g} s before prefill happened while a task with a "
                f"different LoRA setting ran ({_num(dl['total_s']):.1f} s in total, longest {_num(dl['max_s']):.1f} s); "
                "slots with different LoRA settings cannot share a batch, and prompt eval time does not include this wait.")
        if n < opts.min_samples:
            text += f" Fewer than {opts.min_samples} cases: an indication, not a finding."
        return [_finding(text, "waits", n, n >= opts.min_samples)]
    if n_all:
        return [_finding(f"{n_all} waits of ≥{opts.wait_threshold_s:g} s before prefill; none overlapped a task with a "
                         "different LoRA setting.", "waits", n_all, n_all >= opts.min_samples)]
    return []


def _load(tables: dict[str, pd.DataFrame], ds: Dataset, opts: Options) -> list[Finding]:
    """How idle the server was, and how often tasks ran together."""
    load = tables.get("load")
    if load is None or not {"running", "share"} <= set(load.columns):
        return []
    overall = load[load["scope"] == "overall"] if "scope" in load.columns else load
    running = pd.to_numeric(overall["running"], errors="coerce")
    share = pd.to_numeric(overall["share"], errors="coerce")
    idle = float(share[running == 0].sum())
    two = float(share[running >= 2].sum())
    secs = pd.to_numeric(overall.get("seconds", pd.Series(dtype=float)), errors="coerce").sum()
    most = int(running[share > 0].max()) if (share > 0).any() else 0
    return [_finding(f"The server was idle {percent(idle)} of the observed {secs / 3600:.2f} h; two or more tasks ran "
                     f"together {percent(two)} of the time (max {most} at once).", "load", ds.n_tasks, ds.n_tasks >= opts.min_samples)]


def _breakdown(tables: dict[str, pd.DataFrame], ds: Dataset, opts: Options) -> list[Finding]:
    """The share of task time that was own generation, and the share contention added."""
    bd = tables.get("breakdown")
    if bd is None or not {"component", "seconds"} <= set(bd.columns):
        return []
    allp = bd[bd["purpose"] == "all"] if "purpose" in bd.columns else bd
    comp = allp.set_index("component")["seconds"] if len(allp) else pd.Series(dtype=float)
    tot = float(comp.get("total", comp.drop(labels=["total"], errors="ignore").sum()))
    cont = _num(comp.get("contention"))
    if tot <= 0 or cont is None:
        return []
    gen = _num(comp.get("own_generation")) or 0
    return [_finding(f"Of {tot:,.0f} s of task time, {percent(gen / tot)} was each task's own generation at solo speed and "
                     f"{percent(cont / tot)} was added by contention with other slots.", "breakdown", ds.n_tasks,
                     ds.n_tasks >= opts.min_samples)]


def _prefills(tables: dict[str, pd.DataFrame], ds: Dataset, opts: Options) -> list[Finding]:
    """How many big prefills there were, by cause."""
    pf = tables.get("prefills")
    if pf is None or not {"by", "value", "count"} <= set(pf.columns):
        return []
    causes = pf[pf["by"] == "cause"]
    n = int(pd.to_numeric(causes["count"], errors="coerce").fillna(0).sum())
    if not n:
        return []
    parts = ", ".join(f"{r.value.replace('_', ' ')} {int(r.count)}" for r in causes.itertuples() if int(r.count))
    return [_finding(f"{n} prefills of ≥{opts.big_prefill_tokens:,} new tokens: {parts}.", "prefills", n, n >= opts.min_samples)]


def findings(ds: Dataset, opts: Options, tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Sentences about stalls, waits, load, breakdown and long prefills, with counts."""
    rows = [f for about in (_stalls, _waits, _load, _breakdown, _prefills) for f in about(tables, ds, opts)]
    return pd.DataFrame(rows, columns=FINDING_COLUMNS)
