"""The regime map: where the process boundary pays, from an emulated-device sweep.

Per point, each mode's bound per batch (ms): the device, the host's issue, and the
scheduler's own work. With the forward in its own process they overlap:
proc-ahead's bound is max(device, issue, t_sched). On a forward thread the issue and the
scheduler share one GIL: thread-ahead's bound is max(device, issue + t_sched). A point is
launch-bound where issue + t_sched >= 1.4 x max(device, issue, t_sched).

The sensitivity map draws, per model (and switch interval), proc-ahead's uncached ITPS over
another mode's on a grid of per-batch token budgets (x) and host launch costs (y). Each cell
names the term that binds proc-ahead there (the largest of device, issue and scheduler, as
measured in its run), and a line marks where the bound formula's launch-bound region
begins: the 1.4 contour of (issue + t_sched) / max(device, issue, t_sched).
"""

from __future__ import annotations

import math
import os

LAUNCH_BOUND_FACTOR = 1.4
TERMS = {"t_device_ms": "device", "t_issue_ms": "issue", "t_sched_ms": "scheduler"}
SHORT = {"device": "device", "issue": "issue", "scheduler": "sched"}  # in a map's cells


def bounds_ms(run: dict) -> dict[str, float]:
    device = run["t_device_ms"]
    issue = run["t_issue_ms"]
    sched = run["t_sched_ms"]
    return {"process": max(device, issue, sched), "thread": max(device, issue + sched)}


def of_bound(run: dict) -> float:
    """A proc-ahead run's uncached ITPS over its bound: its uncached tokens per batch at
    max(device, issue, t_sched) per batch."""
    per_batch_s = bounds_ms(run)["process"] / 1e3
    return run["uncached_itps"] / (run["uncached_tokens"] / run["num_batches"] / per_batch_s)


def launch_ratio(run: dict) -> float:
    """(issue + t_sched) / max(device, issue, t_sched): what the thread pays over the
    process, in the bound formula; at LAUNCH_BOUND_FACTOR or more a point is launch-bound."""
    return (run["t_issue_ms"] + run["t_sched_ms"]) / bounds_ms(run)["process"]


def is_launch_bound(run: dict) -> bool:
    return launch_ratio(run) >= LAUNCH_BOUND_FACTOR


def binding_term(run: dict) -> str:
    """The term of max(device, issue, t_sched) that binds `run`: device, issue or scheduler."""
    return TERMS[max(TERMS, key=lambda k: run[k])]


def run_of(result: dict, mode: str) -> dict | None:
    return {r["mode"]: r for r in result["runs"]}.get(mode)


def ratio(results: dict, a: str, b: str) -> float | None:
    run_a, run_b = run_of(results, a), run_of(results, b)
    if run_a is None or run_b is None:
        return None
    return run_a["uncached_itps"] / run_b["uncached_itps"]


def _panel(server: dict) -> str:
    return f"{server['emulate_model']}, switch {server['switch_interval_ms']:g} ms"


def grid(results: list[dict]) -> tuple[list[str], list[float], list[int], dict]:
    """Panels (a model at a switch interval), launch costs (rows), per-batch token budgets
    (columns), and the result at each (panel, launch, budget)."""
    cells = {}
    for res in results:
        server = res["config"]["server"]
        key = (_panel(server), server["emulate_launch_us"], server["chunked_prefill_size"])
        cells[key] = res
    panels = list(dict.fromkeys(p for p, _, _ in cells))
    launches = sorted({x for _, x, _ in cells})
    chunks = sorted({c for _, _, c in cells})
    return panels, launches, chunks, cells


def plot_sensitivity_maps(results: list[dict], path: str) -> list[str]:
    """proc-ahead / thread-ahead at `path`, and proc-ahead / overlap beside it (`_overlap`
    before the suffix) where the sweep ran overlap: PNGs drawn as the timeline is
    (matplotlib's Figure on its Agg canvas, no pyplot). Returns the paths written."""
    written = []
    root, ext = os.path.splitext(path)
    for other, out in (("thread-ahead", path), ("overlap", f"{root}_overlap{ext or '.png'}")):
        if any(ratio(res, "proc-ahead", other) is not None for res in results):
            _plot(results, other, out)
            written.append(out)
    return written


def _plot(results: list[dict], other: str, path: str) -> None:
    from matplotlib.figure import Figure

    panels, launches, chunks, cells = grid(results)
    fig = Figure(figsize=(1.6 + 2.8 * len(panels), 2.0 + 0.6 * len(launches)), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, panel in zip(axes, panels):
        values, launchiness = [], []
        for launch in launches:
            row, lrow = [], []
            for chunk in chunks:
                res = cells.get((panel, launch, chunk))
                pa = run_of(res, "proc-ahead") if res else None
                row.append((ratio(res, "proc-ahead", other) if res else None) or math.nan)
                lrow.append(launch_ratio(pa) if pa else math.nan)
                if pa is not None:
                    text = f"{row[-1]:.2f}x\n{SHORT[binding_term(pa)]}"
                    ax.text(len(row) - 1, len(values), text, ha="center", va="center", fontsize=7)
            values.append(row)
            launchiness.append(lrow)
        image = ax.imshow(values, cmap="RdYlGn", vmin=0.75, vmax=1.75, origin="lower")
        if len(launches) > 1 and len(chunks) > 1:
            ax.contour(launchiness, levels=[LAUNCH_BOUND_FACTOR], colors="k", linewidths=1.2)
        ax.set_xticks(range(len(chunks)), [str(c) for c in chunks])
        ax.set_yticks(range(len(launches)), [f"{x:g}" for x in launches])
        ax.set_xlabel("new tokens per batch")
        ax.set_title(panel, fontsize=9)
    axes[0].set_ylabel("launch cost (us per kernel)")
    server = results[0]["config"]["server"]
    fig.suptitle(
        f"proc-ahead / {other} uncached ITPS, emulated {server['emulate_gpu']}, medians\n"
        "cell: the ratio and the term binding proc-ahead (device, issue, sched)\n"
        f"line: issue + sched = {LAUNCH_BOUND_FACTOR} x max(device, issue, sched)",
        fontsize=8,
    )
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    fig.savefig(path, dpi=110)
