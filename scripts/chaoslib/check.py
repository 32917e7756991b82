"""The chaos run's verdict: one reply each, right tokens, every error explained by a fault.

The router leg's replies are generations: each token is checked against the offline
engine's greedy token after the prompt and the reply's own tokens before it (teacher
forcing), so a near tie early on does not make every later token differ."""

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
ROUTER_EXITS = {"router_sigterm": 0, "router_decode_sigterm": 0}  # with the router leg
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
    # through the router: the prefill's refusal, or the decode's word of it (bootstrap_server.py)
    if error == "overloaded" or error.endswith("refused the request: overloaded"):
        seen = rec.outstanding_peak if rec.via == "router" else rec.outstanding_at_send
        return "overload" if seen + f.queue_slack >= f.max_queued else None
    if f.worker_kill is not None and rec.t_reply >= f.worker_kill:
        return "worker-kill"  # the server fails everything and exits
    if rec.via == "router":  # its decode server is never restarted
        return None
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
        if rec.via == "router":  # the router's reply is the decode server's
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
    """Every done reply's tokens against the offline normal-mode engine (`model_kw`: the
    sliding-window flags the server ran with): the first token after the prompt, and for
    a generation each token after the prompt and the reply's tokens before it."""
    done = [r for r in records if r.replies and r.replies[0].get("status") == "done"]
    done = [r for r in done if "malformed" not in r.replies[0]]
    ref = _reference([s for r in done for s, _ in _steps(r)], page_size, max(chunk, 512), model_kw)
    wrong = []
    ties = 0
    for rec in done:
        for k, (seq, got) in enumerate(_steps(rec)):
            want, logits = ref[seq]
            if got == want:
                continue
            if (
                isinstance(got, int)
                and 0 <= got < len(logits)
                and logits[got] >= logits[want] - NEAR_TIE
            ):
                ties += 1
            else:
                wrong.append((rec.rid, k, got, want))
    prompts = len({tuple(r.prompt) for r in done})
    return {
        "checked": len(done),
        "prompts": prompts,
        "sequences": len(ref),
        "near_ties": ties,
        "wrong": wrong,
    }


def _steps(rec: Record) -> list[tuple[tuple[int, ...], object]]:
    """(sequence, the reply's token after it) for each token a reply carries."""
    reply = rec.replies[0]
    if rec.via != "router":
        return [(tuple(rec.prompt), reply.get("first_token"))]
    out = reply.get("output_ids") or []
    return [(tuple(rec.prompt + out[:k]), t) for k, t in enumerate(out)]


def _reference(seqs, page_size: int, chunk: int, model_kw: dict) -> dict[tuple, tuple]:
    """{sequence: (greedy next token, its logits)}; the chunk size does not change first
    tokens (near ties aside), only the speed."""
    from mpprefill.engine import PrefillEngine

    unique = list(dict.fromkeys(seqs))
    ref: dict[tuple, tuple[int, object]] = {}
    with PrefillEngine(
        forward_mode="normal", page_size=page_size, chunked_prefill_size=chunk, **model_kw
    ) as eng:
        for i in range(0, len(unique), 128):
            part = unique[i : i + 128]
            for p, o in zip(part, eng.prefill([list(p) for p in part], return_logits=True)):
                ref[p] = (o.first_token, o.logits)
    return ref


def check_router(records: list[Record], tokens: dict) -> dict:
    """The router leg's figures: sent, ok (every token right, the whole length, finish
    `length`), streamed (of those ok), wrong (a done reply that is not ok), errors."""
    routed = [r for r in records if r.via == "router"]
    bad_tokens = {w[0] for w in tokens["wrong"]}
    out = Counter(sent=len(routed))
    wrong = []
    for rec in routed:
        reply = rec.replies[0] if rec.replies else {}
        if reply.get("status") != "done":
            out["errors" if reply else "unanswered"] += 1
            continue
        why = _router_problem(rec, reply, bad_tokens)
        if why is None:
            out["ok"] += 1
            out["streamed"] += rec.stream
        else:
            out["wrong"] += 1
            wrong.append((rec.rid, why))
    return {**{k: out[k] for k in ("sent", "ok", "streamed", "wrong", "errors")}, "problems": wrong}


def _router_problem(rec: Record, reply: dict, bad_tokens: set[str]) -> str | None:
    n = rec.max_new_tokens
    if "malformed" in reply:
        return f"malformed answer: {reply['malformed']}"
    if rec.rid in bad_tokens:
        return "a token differs from the reference"
    if len(reply["output_ids"]) != n or reply["completion_tokens"] != n:
        return f"{len(reply['output_ids'])} tokens of {n}"
    if reply["finish_reason"] != {"type": "length", "length": n}:
        return f"finish_reason {reply['finish_reason']}"
    if rec.stream != (reply["events"] > 0):
        return f"stream={rec.stream} but {reply['events']} events"
    return None


def check_registrations(router) -> list[str]:
    """The bootstrap endpoint refuses only rooms whose request the prefill failed."""
    bad = []
    for room, why in router.room_refusals:
        rec = router.by_room.get(room)
        failed = rec is not None and rec.replies and rec.replies[0].get("status") == "error"
        if not failed:
            bad.append(f"room {room} refused at the endpoint ({why}) but its request did not fail")
    return bad


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
    router = check_router(records, tokens)
    registrations = check_registrations(r)
    run.mark("reference")
    counts = replies["counts"]
    no_leak = not (leaks["segments"] or leaks["ipc_files"] or leaks["ipc_dir_left"])
    no_leak = no_leak and not leaks["processes"]
    expected_exits = EXPECTED_EXITS
    if run.router_skipped is None:
        expected_exits = tuple({**e, **ROUTER_EXITS} for e in EXPECTED_EXITS)
    checks = {
        "one reply per request": not (counts.get("not_one_reply") or counts.get("extra_replies")),
        "no wrong first token": not tokens["wrong"],
        "every error explained by a fault": not replies["unexplained"],
        "hostile frames answered (rid readable) or logged": not hostile["wrong"],
        "decode side agrees": not decode["disagree"] and not decode["missing"],
        "no stray replies": not r.stray,
        "invariants after drain": invariants.get("ok") is True,
        "exit codes (serve 1 after worker kill or 0, others 0)": exits in expected_exits,
        "no leftover segments, ipc files or HTTP fronts": no_leak,
        "the bootstrap endpoint refused only rooms of failed requests": not registrations,
        "run completed": not run.problems,
    }
    if run.router_skipped is None:
        checks["router leg ran, every reply right"] = router["ok"] > 0 and not router["wrong"]
    problems = [*run.problems, *map(str, replies["unexplained"]), *map(str, tokens["wrong"])]
    problems += [*map(str, hostile["wrong"]), *map(str, decode["disagree"]), *map(str, r.stray)]
    problems += [*map(str, router["problems"]), *registrations]
    return {
        "mode": a.forward_mode,
        "tp_size": a.tp_size,
        "host_store_size": a.host_store_size,
        "layerwise_send": a.disaggregation_layerwise_send,
        "seed": a.seed,
        "phases_s": run.phases,
        "wall_s": time.monotonic() - run.t0,
        "requests": len(records),
        "faults": dict(run.injected),
        "hostile": {"sent": len(r.hostile_sent), **hostile},
        "replies": replies,
        "decode": decode,
        "tokens": tokens,
        "router": {"skipped": run.router_skipped} if run.router_skipped else router,
        "registrations": {
            "accepted": r.counts["rooms_registered"],
            "refused": len(r.room_refusals),
        },
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
