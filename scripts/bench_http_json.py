#!/usr/bin/env python
"""Micro-measurement: the HTTP front's JSON work per request with the standard library
against orjson, to decide whether orjson is worth a dependency.

The front parses each /generate body, and for the protocol encodes a generate frame and
parses the server's reply, then encodes the HTTP reply. Times are medians of repeats, in
microseconds per operation, for a prompt of --prompt-len token ids (and a batch of
--batch such prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

try:
    import orjson
except ImportError:  # the measurement needs it; the project does not
    orjson = None


def _time(fn, n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def cases(prompt_len: int, batch: int) -> dict[str, tuple[str, object]]:
    ids = [(i * 7919) % 128000 for i in range(prompt_len)]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    batch_body = {"input_ids": [ids] * batch, "sampling_params": {"temperature": 0}}
    frame = {"type": "generate", "rid": "a" * 32, "input_ids": ids, "sampling_params": {}}
    reply = {"output_ids": [42], "meta_info": {"id": "a" * 32, "prompt_tokens": prompt_len}}
    return {
        "parse /generate body": ("loads", json.dumps(body).encode()),
        f"parse batch body ({batch} prompts)": ("loads", json.dumps(batch_body).encode()),
        "encode generate frame": ("dumps", frame),
        "encode reply body": ("dumps", reply),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if orjson is None:
        raise SystemExit("pip install orjson to run this measurement")
    print(f"{'operation':<34} {'json us':>9} {'orjson us':>10} {'speed-up':>9}")
    for name, (op, data) in cases(args.prompt_len, args.batch).items():
        n = max(1, args.n // (args.batch if "batch" in name else 1))
        std = json.loads if op == "loads" else lambda d: json.dumps(d, separators=(",", ":"))
        fast = orjson.loads if op == "loads" else orjson.dumps
        t_std = _time(lambda: std(data), n, args.repeats)  # noqa: B023
        t_fast = _time(lambda: fast(data), n, args.repeats)  # noqa: B023
        print(f"{name:<34} {t_std:9.1f} {t_fast:10.1f} {t_std / t_fast:8.1f}x")


if __name__ == "__main__":
    main()
