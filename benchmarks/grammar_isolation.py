"""What one costly constrained request does to everyone else: an innocent greedy stream's
inter-token gaps alone, while a client keeps sending an ambiguous grammar at ``n=8``
(``root ::= s``, ``s ::= s s | "a" | "b" | "c"``: its matcher grows slower with every
token; refused when it compiles), while a client keeps sending the same grammar behind 80
digits (``late grammar``: it passes the compile-time walk and is ended by the per-step mask
budget), and, to tell the grammar's cost from the batch's, while a client keeps sending the
same request without a grammar (``max_tokens`` 24), each at most 4 requests a second.
Rounds alternate the conditions on one server; the table gives the innocent stream's median
and largest gap per condition, their ratios to the stream alone, and what the other client
got back (status, seconds).
Prints a table, writes JSON.

    python benchmarks/grammar_isolation.py [--rounds 3] [--tokens 64] [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import write_json  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
HOSTILE = {"model": MODEL, "prompt": "x", "guided_grammar": 'root ::= s\ns ::= s s | "a" | "b" | "c"',
           "max_tokens": 400, "temperature": 1, "seed": 1, "n": 8}
LATE = {**HOSTILE, "guided_grammar": 'root ::= [0-9]{80} s\ns ::= s s | "a" | "b" | "c"'}
FREE = {"model": MODEL, "prompt": "x", "max_tokens": 24, "temperature": 1, "seed": 1, "n": 8, "ignore_eos": True}
CONDITIONS = {"alone": None, "free n=8": FREE, "grammar n=8": HOSTILE, "late grammar n=8": LATE}


Reply = tuple[http.client.HTTPResponse, http.client.HTTPConnection]


def post(port: int, body: dict[str, Any], timeout: float) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn.getresponse(), conn


def innocent(port: int, tokens: int) -> list[float]:
    """Seconds between the stream's successive token chunks."""
    body = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    r, conn = post(port, body, 600)
    stamps = []
    for line in r:
        if line.startswith(b"data: {"):
            stamps.append(time.perf_counter())
    conn.close()
    return [b - a for a, b in itertools.pairwise(stamps[1:])]  # from the second token: the first waits for prefill


def other_loop(port: int, body: dict[str, Any], stop: threading.Event, seen: list[tuple[int, float]],
               timeout: float, interval: float) -> None:
    """Send ``body`` again as each reply comes, at most one request per ``interval`` seconds."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r, conn = post(port, body, timeout)
            r.read()
            seen.append((r.status, time.perf_counter() - t0))
            conn.close()
        except TimeoutError:
            seen.append((-1, time.perf_counter() - t0))  # dropped by us: the server aborts it
        stop.wait(max(0.0, interval - (time.perf_counter() - t0)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the innocent stream")
    ap.add_argument("--hostile-timeout", type=float, default=60.0, help="seconds before a hostile request is dropped")
    ap.add_argument("--interval", type=float, default=0.25,
                    help="least seconds between the other client's requests (a refused grammar is answered at once; "
                         "a flood of any cheap request is a matter for rate limits, not grammars)")
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar_isolation.json"))
    args = ap.parse_args()
    server = None
    if args.url is None:
        from tests.server.conftest import start_server, stop_server

        log = Path(args.out).with_suffix(".server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        server = start_server(["--no-access-log"], log)
        port = server.port
    else:
        port = int(args.url.rsplit(":", 1)[1])
    gaps: dict[str, list[float]] = {k: [] for k in CONDITIONS}
    seen: dict[str, list[tuple[int, float]]] = {k: [] for k in CONDITIONS}
    try:
        innocent(port, 8)  # warm-up
        for _ in range(args.rounds):
            for name, body in CONDITIONS.items():
                stop = threading.Event()
                t = threading.Thread(target=other_loop, args=(port, body, stop, seen[name], args.hostile_timeout,
                                                                   args.interval))
                if body is not None:
                    t.start()
                    time.sleep(0.5)  # the other request is in before the innocent one
                gaps[name] += innocent(port, args.tokens)
                stop.set()
                if body is not None:
                    t.join()
    finally:
        if server is not None:
            stop_server(server)
    rows: dict[str, dict[str, Any]] = {}
    for k, v in gaps.items():
        statuses: dict[int, int] = {}
        for s, _ in seen[k]:
            statuses[s] = statuses.get(s, 0) + 1
        rows[k] = {"median_ms": statistics.median(v) * 1e3, "max_ms": max(v) * 1e3, "gaps": len(v),
                   "other_statuses": statuses, "other_median_s": statistics.median(d for _, d in seen[k])
                   if seen[k] else None}
    for r in rows.values():
        r["median_x"] = r["median_ms"] / rows["alone"]["median_ms"]
        r["max_x"] = r["max_ms"] / rows["alone"]["max_ms"]
    head = f"{'innocent stream':<17} {'median gap ms':>14} {'x alone':>8} {'max gap ms':>11} {'x alone':>8}"
    print(head + "  other client")
    for k, r in rows.items():
        other = "" if k == "alone" else f"{r['other_statuses']} in {r['other_median_s']:.2f} s (median)"
        print(f"{k:<17} {r['median_ms']:>14.1f} {r['median_x']:>8.2f} {r['max_ms']:>11.1f} {r['max_x']:>8.2f}  {other}")
    print("wrote", write_json({"rows": rows, "rounds": args.rounds, "tokens": args.tokens,
                              "interval_s": args.interval}, args.out))


if __name__ == "__main__":
    main()
