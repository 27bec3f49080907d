"""Server memory under many distinct JSON schemas: ``--schemas`` requests, each with its own
1,500-value enum (about 1.6 MB compiled), one after another; the server's resident memory
(and its compile process's, where there is one) every ``--every`` schemas, against the
grammar cache's bound. Prints a table (the curve), writes JSON.

    python benchmarks/grammar_memory.py [--schemas 300] [--every 25] [--cache 256MiB]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import string
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import write_json  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0


def children(pid: int) -> list[int]:
    """The processes ``pid``'s threads started."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def schema(rng: random.Random) -> dict[str, Any]:
    words = ["".join(rng.choices(string.ascii_lowercase, k=8)) for _ in range(1500)]
    return {"type": "object", "properties": {"e": {"enum": words}}, "required": ["e"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", type=int, default=300)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--cache", default="256MiB", help="the server's --grammar-cache-memory")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grammar_memory.json"))
    args = ap.parse_args()
    from tests.server.conftest import start_server, stop_server
    from tests.server.http import raw

    log = Path(args.out).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(["--no-access-log", "--grammar-cache-memory", args.cache], log)
    rng = random.Random(0)
    curve: list[dict[str, Any]] = []
    statuses: dict[int, int] = {}
    try:
        raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                            "guided_json": {"type": "integer"}})  # the vocabulary, read once
        time.sleep(1)
        base = rss_mib(server.proc.pid)
        t0 = time.perf_counter()
        for i in range(1, args.schemas + 1):
            status, _ = raw(server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                             "guided_json": schema(rng)})
            statuses[status] = statuses.get(status, 0) + 1
            if i % args.every == 0:
                row = {"schemas": i, "server_mib": rss_mib(server.proc.pid),
                       "compile_process_mib": sum(rss_mib(c) for c in children(server.proc.pid)),
                       "seconds": time.perf_counter() - t0}
                row["server_growth_mib"] = row["server_mib"] - base
                curve.append(row)
                print(f"{i:>5} schemas: server {row['server_mib']:7.0f} MiB (+{row['server_growth_mib']:.0f}), "
                      f"compile process {row['compile_process_mib']:6.0f} MiB, {row['seconds']:.0f} s", flush=True)
    finally:
        stop_server(server)
    print(f"statuses {statuses}; server growth at the end {curve[-1]['server_growth_mib']:.0f} MiB "
          f"with --grammar-cache-memory {args.cache}")
    print("wrote", write_json({"cache": args.cache, "base_mib": base, "curve": curve, "statuses": statuses},
                              args.out))


if __name__ == "__main__":
    main()
