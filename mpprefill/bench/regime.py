"""The regime map: where the process boundary pays, from an emulated-device sweep.

Per point, each mode's bound per batch (ms): the device, the host's issue, and the
scheduler's own work. With the forward in its own process they overlap:
proc-ahead's bound is max(device, issue, t_sched). On a forward thread the issue and the
scheduler share one GIL: thread-ahead's bound is max(device, issue + t_sched). A point is
launch-bound where issue + t_sched >= 1.4 x max(device, issue, t_sched).
"""

from __future__ import annotations

LAUNCH_BOUND_FACTOR = 1.4


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


def is_launch_bound(run: dict) -> bool:
    b = bounds_ms(run)
    return run["t_issue_ms"] + run["t_sched_ms"] >= LAUNCH_BOUND_FACTOR * b["process"]


def ratio(results: dict, a: str, b: str) -> float | None:
    by = {r["mode"]: r for r in results["runs"]}
    if a not in by or b not in by:
        return None
    return by[a]["uncached_itps"] / by[b]["uncached_itps"]


def grid(results: list[dict]) -> tuple[list[str], list[int], dict[tuple[str, int], dict]]:
    """Models (rows), per-batch token budgets (columns), and the result at each cell."""
    cells = {}
    for res in results:
        server = res["config"]["server"]
        cells[(server["emulate_model"], server["chunked_prefill_size"])] = res
    models = list(dict.fromkeys(m for m, _ in cells))
    chunks = sorted({c for _, c in cells})
    return models, chunks, cells


def plot_regime_map(results: list[dict], path: str) -> None:
    """A heat map of proc-ahead / thread-ahead uncached ITPS over the grid (PNG), drawn as
    the timeline is: matplotlib's Figure on its Agg canvas, no pyplot."""
    from matplotlib.figure import Figure

    models, chunks, cells = grid(results)
    values = [[_pa_over_ta(cells[(m, c)]) for c in chunks] for m in models]
    fig = Figure(figsize=(2.2 + 1.6 * len(chunks), 1.4 + 0.9 * len(models)))
    ax = fig.subplots()
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.75, vmax=1.75)
    ax.set_xticks(range(len(chunks)), [f"{c} tokens" for c in chunks])
    ax.set_xlabel("new tokens per batch (chunked prefill size)")
    ax.set_yticks(range(len(models)), models)
    for i, m in enumerate(models):
        for j, c in enumerate(chunks):
            res = cells[(m, c)]
            pa = {r["mode"]: r for r in res["runs"]}.get("proc-ahead")
            tag = "\nlaunch-bound" if pa is not None and is_launch_bound(pa) else ""
            ax.text(j, i, f"{values[i][j]:.2f}x{tag}", ha="center", va="center", fontsize=9)
    server = results[0]["config"]["server"]
    transfer = server["disaggregation_transfer_backend"]
    ax.set_title(
        "proc-ahead / thread-ahead uncached ITPS\n"
        f"(emulated {server['emulate_gpu']}, hit rate 0.8, {transfer} transfer)"
    )
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _pa_over_ta(res: dict) -> float:
    return ratio(res, "proc-ahead", "thread-ahead") or 0.0
