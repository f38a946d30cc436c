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
    for n in rep["notes"]:
        text += f"\n\nnote: {n}"
    for f in rep["failures"][:50]:
        text += (f"\n\n**{f['outcome']}** trial {f['id']} ({f['store']}/{f['fault']}{_large(f)}, run {f['run']}, "
                 f"point {f['point']!r}): " + "; ".join(f["reasons"]))
    return text


def chart(rep: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = rep["rows"]
    if not rows:
        return False
    labels = [f"{r['store']}\n{r['fault']}{_large(r)}" for r in rows]
    colors = {"ok": "#4caf50", "indeterminate": "#90caf9", "lost": "#e53935", "corrupt": "#8e24aa",
              "error": "#ffb300", SKIPPED: "#e0e0e0"}
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    bottom = [0] * len(rows)
    for o in (*OUTCOMES, SKIPPED):
        vals = [r.get(o, 0) for r in rows]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label="skipped (not run)" if o == SKIPPED else o, color=colors[o],
                   hatch="//" if o == SKIPPED else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_yscale("symlog")
    ax.set_ylim(0, max(bottom) * 2)   # symlog's automatic top clips the tallest bar
    ax.set_ylabel("trials")
    t = rep["totals"]
    title = f"agck crash campaign: {t['trials']} trials, {t['lost']} lost, {t['corrupt']} corrupt"
    if t.get(SKIPPED):
        title += f", {t[SKIPPED]} skipped"
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    plt.xticks(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
