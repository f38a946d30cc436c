"""The crash campaign's report: a table per (store, fault, profile), JSON, markdown, a chart, the exit status.

Contract: :func:`report` reads a finished campaign (any object with ``trials``, a
list of classified :class:`crashtests.checker.Trial`; ``cfg``, its Config;
``notes``; optionally ``pg_kills``) and returns a JSON-able dict, a row per store,
fault and profile (the workload's state size: small, or large). A trial that
never started (``skipped``, the time limit) is counted apart: a row's ``trials``
and outcome counts are of the trials that ran, its ``skipped`` those that did
not, and ``rep["skipped"]`` sums them up, naming every fault kind of which no
trial ran. :func:`exit_code` depends only on the trials that ran: 1 if any was
lost or corrupt, else 2 if the harness could not judge one (error), else 0.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from .checker import FAULTS, OUTCOMES, SKIPPED, STORES
from .workload import PROFILES


def report(c, wall: float) -> dict:
    rows = []
    keys = sorted({(t.store, t.fault, t.profile) for t in c.trials},
                  key=lambda k: (STORES.index(k[0]), FAULTS.index(k[1]), PROFILES.index(k[2])))
    for store, fault, profile in keys:
        every = [t for t in c.trials if (t.store, t.fault, t.profile) == (store, fault, profile)]
        ts = [t for t in every if not t.skipped]
        secs = [t.rec_seconds for t in ts if t.rec_seconds is not None]
        row = {"store": store, "fault": fault, "profile": profile, "trials": len(ts), SKIPPED: len(every) - len(ts),
               "faults_delivered": sum(t.reached for t in ts),
               "crash_points": len({t.point for t in ts if t.reached and t.point}),
               **{o: sum(t.outcome == o for t in ts) for o in OUTCOMES},
               "median_recovery_ms": round(1000 * statistics.median(secs), 2) if secs else None,
               "resumes_checked": sum(t.resume is not None for t in ts),
               "resumes_ok": sum(bool(t.resume and t.resume.get("ok")) for t in ts)}
        rows.append(row)
    totals = {k: sum(r[k] for r in rows) for k in ("trials", SKIPPED, "faults_delivered", "ok", "indeterminate",
                                                    "lost", "corrupt", "error", "resumes_checked", "resumes_ok")}
    cfg = c.cfg
    ran = {f: sum(r["trials"] for r in rows if r["fault"] == f) for f in FAULTS}
    skipped = {"total": totals[SKIPPED], "time_limit": cfg.time_limit,
               "rows": [{"store": r["store"], "fault": r["fault"], "profile": r["profile"], SKIPPED: r[SKIPPED]}
                        for r in rows if r[SKIPPED]],
               "faults_not_run": [f for f in FAULTS if not ran[f] and any(r[SKIPPED] for r in rows
                                                                          if r["fault"] == f)]}
    out = {"config": {k: v for k, v in vars(cfg).items() if k != "counts"} | {
               "counts": {str(k): v for k, v in cfg.counts.items()}},
           "rows": rows, "totals": totals, "skipped": skipped, "wall_seconds": round(wall, 1), "notes": c.notes,
           "postgres_kills": getattr(c, "pg_kills", None),
           "s3_kills": getattr(c, "s3_kills", None) or None,
           # wall seconds per phase (each fault kind's trials, the servers' setup, the checks)
           "phase_seconds": {k: round(v, 1) for k, v in sorted((getattr(c, "seconds", None) or {}).items(),
                                                               key=lambda kv: -kv[1])},
           "failures": [t.as_dict() for t in c.trials if t.outcome in ("lost", "corrupt", "error")],
           "trials": [t.as_dict() for t in c.trials]}
    return out


def skipped_summary(rep: dict) -> list[str]:
    """What the time limit left out, in words: one line, a loud one per fault kind that did
    not run at all; none when every trial ran."""
    sk = rep.get("skipped") or {}
    if not sk.get("total"):
        return []
    where = ", ".join(f"{r['store']}/{r['fault']}{_large(r)} {r[SKIPPED]}" for r in sk["rows"])
    lines = [f"**skipped**: {sk['total']} trials not started before the campaign time limit "
             f"({sk['time_limit']:g} s): {where}. They were not run, so they are not judged: the exit "
             f"status counts only the {rep['totals']['trials']} trials that ran."]
    for f in sk["faults_not_run"]:
        n = sum(r[SKIPPED] for r in sk["rows"] if r["fault"] == f)
        lines.append(f"**WARNING: no `{f}` trial ran** (all {n} skipped by the time limit): this campaign "
                     f"says nothing about `{f}`.")
    return lines


def _large(row: dict) -> str:
    return " (large)" if row.get("profile", "small") != "small" else ""


def markdown(rep: dict) -> str:
    cols = ["store", "fault", "profile", "trials", SKIPPED, "faults_delivered", "crash_points", "ok", "indeterminate",
            "lost", "corrupt", "error", "median_recovery_ms", "resumes_ok"]
    heads = ["store", "fault", "state", "trials", "skipped", "faults hit", "distinct points", "ok", "indeterminate",
             "lost", "corrupt", "error", "median recovery (ms)", "resumes ok"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join("---:" if i > 1 else "---" for i in range(len(cols))) + "|"]
    for r in rep["rows"]:
        cells = []
        for k in cols:
            v = r.get(k)
            if k == "resumes_ok":
                v = f"{r['resumes_ok']}/{r['resumes_checked']}"
            cells.append("-" if v is None else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    t = rep["totals"]
    lines.append(f"| **total** | | | {t['trials']} | {t.get(SKIPPED, 0)} | {t['faults_delivered']} | | {t['ok']} | "
                 f"{t['indeterminate']} | {t['lost']} | {t['corrupt']} | {t['error']} | | "
                 f"{t['resumes_ok']}/{t['resumes_checked']} |")
    text = "\n".join(lines)
    for s in skipped_summary(rep):
        text += f"\n\n{s}"
    text += f"\n\nwall time {rep['wall_seconds']} s"
    if rep.get("postgres_kills") is not None:
        text += f"; Postgres server kills: {rep['postgres_kills']}"
    if rep.get("s3_kills"):
        text += f"; object store server kills: {rep['s3_kills']}"
    if rep.get("phase_seconds"):
        text += "\n\nwall seconds by phase: " + ", ".join(f"{k} {v}" for k, v in rep["phase_seconds"].items())
    for n in rep["notes"]:
        text += f"\n\nnote: {n}"
    for f in rep["failures"][:50]:
        text += (f"\n\n**{f['outcome']}** trial {f['id']} ({f['store']}/{f['fault']}{_large(f)}, run {f['run']}, "
                 f"point {f['point']!r}): " + "; ".join(f["reasons"]))
    return text


# the chart's cells: fill, text colour, and what the legend calls them (worst first)
CELL_STYLE = {"bad": ("#d32f2f", "white", "lost or corrupt"), "error": ("#ffb300", "black", "harness error"),
              "indeterminate": ("#bbdefb", "black", "indeterminate"), "ok": ("#c8e6c9", "black", "all ok"),
              SKIPPED: ("#eeeeee", "#555555", "skipped only (not run)")}
CHART_DPI = 100
_LINE_IN = 0.2          # one 10 pt line of a cell, in inches


def _cell(row: dict) -> tuple[str, list[str]]:
    """A (store, fault, profile) row as one cell of the chart: its state and its lines."""
    n = row["trials"]
    if n == 0:
        return SKIPPED, [f"{row[SKIPPED]} skipped"]
    lines = [f"{n} trial{'s' if n != 1 else ''}", f"{row['faults_delivered']} hit"]
    lines += [f"{row[o]} {o}" for o in ("lost", "corrupt", "error") if row[o]]
    if row["indeterminate"]:
        lines.append(f"{row['indeterminate']} indeterm.")
    if row[SKIPPED]:
        lines.append(f"+{row[SKIPPED]} skipped")
    state = ("bad" if row["lost"] or row["corrupt"] else "error" if row["error"]
             else "indeterminate" if row["indeterminate"] else "ok")
    return state, lines


def grid(rep: dict) -> dict:
    """What :func:`chart` draws: a row per store (and profile), a column per fault kind of the
    campaign, a cell per (store, fault, profile) row of the report; and where, in pixels from
    the picture's top left corner at :data:`CHART_DPI`."""
    rows = rep["rows"]
    faults = [f for f in FAULTS if any(r["fault"] == f for r in rows)]
    stores = sorted({(r["store"], r["profile"]) for r in rows},
                    key=lambda k: (STORES.index(k[0]), PROFILES.index(k[1])))
    labels = [s + _large({"profile": p}) for s, p in stores]
    cells = {}
    for r in rows:
        state, lines = _cell(r)
        cells[(r["store"] + _large(r), r["fault"])] = {"state": state, "lines": lines}
    most = max((len(c["lines"]) for c in cells.values()), default=1)
    label_w = 0.35 + 0.085 * max((len(s) for s in labels), default=6)
    cell_w = min(1.35, max(1.0, (18.0 - label_w) / max(1, len(faults))))
    cell_h = 0.25 + _LINE_IN * most
    grid_w = label_w + cell_w * len(faults)
    t = rep["totals"]
    title = (f"agck crash campaign: {t['trials']} trials, {t['lost']} lost, {t['corrupt']} corrupt, "
             f"resumes {t['resumes_ok']}/{t['resumes_checked']} ok")
    extra = [f"{t[k]} {k}" for k in ("error", "indeterminate", SKIPPED) if t.get(k)]
    title += f" ({', '.join(extra)})" if extra else ""
    width = max(9.0, grid_w + 0.4, 0.135 * len(title) + 0.6)    # a 14 pt bold character: about 0.13 in
    top = 1.0                                     # the title and the column heads above the grid
    height = top + cell_h * len(labels) + 0.75    # the legend below
    width, height = (math.ceil(v * CHART_DPI) / CHART_DPI for v in (width, height))   # whole pixels
    left = (width - grid_w) / 2 + label_w
    px = CHART_DPI
    for (label, fault), c in cells.items():
        i, j = labels.index(label), faults.index(fault)
        x0, y0 = left + j * cell_w, top + i * cell_h
        c["box"] = tuple(round(v * px) for v in (x0, y0, x0 + cell_w, y0 + cell_h))
    return {"title": title, "faults": faults, "labels": labels, "cells": cells, "size": (round(width * px), round(height * px)),
            "inches": {"width": width, "height": height, "left": left, "top": top, "label_w": label_w,
                       "cell_w": cell_w, "cell_h": cell_h}}


def chart(rep: dict, path: str) -> bool:
    """The campaign as a grid of cells, a row per store and a column per fault kind (:func:`grid`),
    red where a trial was lost or corrupt; a PNG of :data:`CHART_DPI` dots per inch."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        return False
    if not rep["rows"]:
        return False
    g = grid(rep)
    box = g["inches"]
    fig = plt.figure(figsize=(box["width"], box["height"]), dpi=CHART_DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, box["width"])
    ax.set_ylim(box["height"], 0)                 # inches from the top left corner, as grid() counts
    ax.axis("off")
    left, top, cw, ch = box["left"], box["top"], box["cell_w"], box["cell_h"]
    for j, fault in enumerate(g["faults"]):
        ax.text(left + (j + 0.5) * cw, top - 0.08, fault, ha="center", va="bottom", fontsize=11, fontweight="bold")
    for i, label in enumerate(g["labels"]):
        ax.text(left - 0.12, top + (i + 0.5) * ch, label, ha="right", va="center", fontsize=11, fontweight="bold")
        for j, fault in enumerate(g["faults"]):
            x, y = left + j * cw, top + i * ch
            c = g["cells"].get((label, fault))
            if c is None:      # no trial of this fault on this store: a blank cell
                ax.add_patch(Rectangle((x, y), cw, ch, facecolor="#fafafa", edgecolor="white", linewidth=2))
                continue
            fill, ink, _ = CELL_STYLE[c["state"]]
            ax.add_patch(Rectangle((x, y), cw, ch, facecolor=fill, edgecolor="white", linewidth=2,
                                   hatch="//" if c["state"] == SKIPPED else None))
            ax.text(x + cw / 2, y + ch / 2, "\n".join(c["lines"]), ha="center", va="center", fontsize=10,
                    color=ink, linespacing=1.25, fontweight="bold" if c["state"] == "bad" else "normal")
    ax.text(box["width"] / 2, 0.3, g["title"], ha="center", va="center", fontsize=14, fontweight="bold")
    ax.text(box["width"] / 2, 0.58, "each cell: the trials run and the faults they delivered (hit)",
            ha="center", va="center", fontsize=10, color="#555555")
    used = {c["state"] for c in g["cells"].values()}
    handles = [Patch(facecolor=fill, edgecolor="#9e9e9e", label=name, hatch="//" if s == SKIPPED else None)
               for s, (fill, _, name) in CELL_STYLE.items() if s in used or s in ("bad", "ok")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=10, frameon=False,
               bbox_to_anchor=(0.5, 0.1 / box["height"]))
    fig.savefig(path, dpi=CHART_DPI)
    plt.close(fig)
    return True


def write_report(rep: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "crash_report.json"), "md": os.path.join(out_dir, "crash_report.md"),
             "png": os.path.join(out_dir, "crash_report.png")}
    with open(paths["json"], "w") as f:
        json.dump(rep, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write("# agck crash campaign\n\n" + markdown(rep) + "\n")
    if not rep["config"].get("chart", True) or not chart(rep, paths["png"]):
        paths.pop("png")
    return paths


def exit_code(rep: dict) -> int:
    """0 all good, 1 any lost or corrupt trial, 2 a trial that ran but could not be judged.
    Skipped trials (never started) count for nothing here."""
    t = rep["totals"]
    if t["lost"] or t["corrupt"]:
        return 1
    if t["error"]:
        return 2
    return 0
