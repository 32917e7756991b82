"""The chaos run's verdict: one reply each, right tokens, every error explained by a fault."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from chaoslib.hostile import Hostile
from chaoslib.workload import Record

# serve exits 1 once its forward process died; without one it is stopped with SIGTERM
EXPECTED_EXITS = (
    {"serve_after_worker_kill": 1, "decode_sigterm": 0},
    {"serve_sigterm": 0, "decode_sigterm": 0},
)
NEAR_TIE = 1e-3  # a differing greedy token within this logit gap of the reference's is a tie


@dataclass
class Faults:
    """When the process faults happened (monotonic seconds), and the queue cap in force."""

    max_queued: int
    queue_slack: int = 8  # hostile frames the server may count as live at the same time
    decode_kill: float | None = None
    decode_ready: float | None = None
    worker_kill: float | None = None


def error_kind(error: str) -> str:
    for key, kind in (
        ("overloaded", "overloaded"),
        ("aborted by client", "aborted"),
        ("worker failure", "worker-failure"),
        ("KV pool", "too-long"),
        ("shutting down", "shutdown"),
        ("bootstrap", "bootstrap"),
        ("transfer", "transfer"),
        ("decode", "transfer"),
    ):
        if key in error:
            return kind
    return "other"


def explain(rec: Record, reply: dict, f: Faults) -> str | None:
    """The fault that explains an error reply, or None."""
    error = reply.get("error") or ""
    if rec.kind == "toolong":
        return "too-long" if "KV pool" in error else None
    if rec.t_abort is not None:
        return "abort"
    if error == "overloaded":
        return "overload" if rec.outstanding_at_send + f.queue_slack >= f.max_queued else None
    if f.worker_kill is not None and rec.t_reply >= f.worker_kill:
        return "worker-kill"  # the server fails everything and exits
    restarted = f.decode_ready is None or rec.t_send < f.decode_ready
    if f.decode_kill is not None and rec.t_reply >= f.decode_kill and restarted:
        return "decode-restart"
    return None


def check_replies(records: list[Record], faults: Faults) -> dict:
    out = Counter()
    unexplained = []
    explained = Counter()
    for rec in records:
        if len(rec.replies) != 1:
            out["not_one_reply"] += 1
            continue
        if rec.unknown_abort_replies > (1 if rec.t_abort is not None else 0):
            out["extra_replies"] += 1
        reply = rec.replies[0]
        if reply.get("status") == "done":
            out["done"] += 1
            continue
        out["error:" + error_kind(reply.get("error", ""))] += 1
        why = explain(rec, reply, faults)
        if why is None:
            unexplained.append((rec.rid, rec.kind, reply.get("error")))
        else:
            explained[why] += 1
    return {"counts": dict(out), "explained": dict(explained), "unexplained": unexplained}


def check_decode(records: list[Record], faults: Faults) -> dict:
    """The decode side's answer agrees with the prefill's for every completed request."""
    bad = []
    missing = 0
    for rec in records:
        done = [r for r in rec.replies if r.get("status") == "done"]
        if len(rec.decode_replies) > 1:
            bad.append((rec.rid, "several decode replies"))
        if not done:
            continue
        near_kill = faults.decode_kill is not None and rec.t_send < (faults.decode_ready or 1e18)
        if not rec.decode_replies:
            missing += 0 if near_kill else 1
            continue
        d = rec.decode_replies[0]
        agree = d.get("status") == "done" and d.get("first_token") == done[0].get("first_token")
        if not agree and not near_kill:
            bad.append((rec.rid, f"decode said {d}"))
    return {"disagree": bad, "missing": missing}


def check_hostile(sent: list[Hostile], null_rid_replies: int) -> dict:
    kinds = Counter(h.kind for h in sent)
    wrong = []
    for h in sent:
        if h.rid is None:
            continue
        statuses = [r.get("status") for r in h.replies]
        if statuses != [h.expect]:
            wrong.append((h.kind, statuses))
    want_null = sum(1 for h in sent if h.rid is None and h.expect != "none")
    if null_rid_replies != want_null:
        wrong.append(("unreadable-rid replies", f"{null_rid_replies} of {want_null}"))
    return {"sent_by_kind": dict(kinds), "wrong": wrong}


def check_tokens(records: list[Record], page_size: int, chunk: int, **model_kw) -> dict:
    """Every done reply's first token against the offline normal-mode engine (`model_kw`:
    the sliding-window flags the server ran with)."""
    from mpprefill.engine import PrefillEngine

    done = [r for r in records if r.replies and r.replies[0].get("status") == "done"]
    prompts = list({tuple(r.prompt): None for r in done})
    ref: dict[tuple, tuple[int, object]] = {}
    chunk = max(chunk, 512)  # first tokens do not depend on it (near ties aside); speed does
    with PrefillEngine(
        forward_mode="normal", page_size=page_size, chunked_prefill_size=chunk, **model_kw
    ) as eng:
        for i in range(0, len(prompts), 128):
            part = prompts[i : i + 128]
            for p, o in zip(part, eng.prefill([list(p) for p in part], return_logits=True)):
                ref[p] = (o.first_token, o.logits)
    wrong = []
    ties = 0
    for rec in done:
        got = rec.replies[0].get("first_token")
        want, logits = ref[tuple(rec.prompt)]
        if got == want:
            continue
        if (
            isinstance(got, int)
            and 0 <= got < len(logits)
            and logits[got] >= logits[want] - NEAR_TIE
        ):
            ties += 1
        else:
            wrong.append((rec.rid, got, want))
    return {"checked": len(done), "prompts": len(prompts), "near_ties": ties, "wrong": wrong}


def summarize(run, invariants: dict, exits: dict, leaks: dict) -> dict:
    """The run's figures and the verdict of every check."""
    a = run.args
    r = run.router
    records = list(r.records.values())
    replies = check_replies(records, run.faults)
    decode = check_decode(records, run.faults)
    hostile = check_hostile(r.hostile_sent, r.null_rid_replies)
    swa = dict(sliding_window=a.sliding_window, swa_layers=a.swa_layers)
    tokens = check_tokens(records, a.page_size, a.chunked_prefill_size, **swa)
    run.mark("reference")
    counts = replies["counts"]
    no_leak = not (leaks["segments"] or leaks["ipc_files"] or leaks["ipc_dir_left"])
    checks = {
        "one reply per request": not (counts.get("not_one_reply") or counts.get("extra_replies")),
        "no wrong first token": not tokens["wrong"],
        "every error explained by a fault": not replies["unexplained"],
        "hostile frames answered (rid readable) or logged": not hostile["wrong"],
        "decode side agrees": not decode["disagree"] and not decode["missing"],
        "no stray replies": not r.stray,
        "invariants after drain": invariants.get("ok") is True,
        "exit codes (serve 1 after worker kill or 0, decode 0)": exits in EXPECTED_EXITS,
        "no leftover segments or ipc files": no_leak,
        "run completed": not run.problems,
    }
    problems = [*run.problems, *map(str, replies["unexplained"]), *map(str, tokens["wrong"])]
    problems += [*map(str, hostile["wrong"]), *map(str, decode["disagree"]), *map(str, r.stray)]
    return {
        "mode": a.forward_mode,
        "seed": a.seed,
        "phases_s": run.phases,
        "wall_s": time.monotonic() - run.t0,
        "requests": len(records),
        "faults": dict(run.injected),
        "hostile": {"sent": len(r.hostile_sent), **hostile},
        "replies": replies,
        "decode": decode,
        "tokens": tokens,
        "invariants": invariants,
        "server_counters": _counters(run.drain_stats),
        "exits": exits,
        "leaks": leaks,
        "checks": checks,
        "problems": problems,
        "ok": all(checks.values()),
    }


def _counters(stats: dict) -> dict:
    c = stats.get("counters", {})
    keys = ("num_finished", "num_failed", "replies_dropped", "bad_frames", "cached_tokens")
    return {k: c.get(k) for k in keys}
