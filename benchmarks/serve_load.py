"""Load test of ``qpage serve``: N concurrent streaming clients on loopback, a share of them
disconnecting mid-stream; requests/s, tokens/s, TTFT and inter-token latency percentiles.

Starts its own server on a free port (or uses ``--url``), runs for ``--duration`` seconds,
lets the last requests finish, then checks through ``/metrics`` that the block pool is back
to all-free (KV usage 0, nothing running or waiting). Prints a table, writes JSON.

``--slow-clients N`` adds N clients without the API key (the script then starts the server
with one) that hold connections open the slow way: a request head sent a line at a time, a
4 MiB body sent in small pieces, or nothing at all, over and over. The table then adds how
long the server let such a connection live and the server's resident memory.

    python benchmarks/serve_load.py [--clients 64] [--duration 60] [--disconnect 0.25] [--slow-clients 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TEXT = ROOT.parent / "shared" / "data" / "wikitext2" / "test.txt"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class SlowStats:
    connections: int = 0
    lifetimes: list[float] = field(default_factory=list)
    """Seconds from connect until the server closed the connection."""
    replies: dict[str, int] = field(default_factory=dict)
    """First status line the server sent (a 401 to a head without a key), by text."""
    rss_mib: list[float] = field(default_factory=list)


@dataclass
class Stats:
    ok: int = 0
    disconnected: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def load_words() -> list[str]:
    if TEXT.is_file():
        words = TEXT.read_text(encoding="utf-8", errors="replace")[:400_000].split()
        if len(words) > 1000:
            return words
    return ("the quick brown fox jumps over the lazy dog while the engine serves many clients " * 200).split()


async def one_request(client: Any, rng: random.Random, words: list[str], args: argparse.Namespace, st: Stats) -> None:
    import openai

    n_words = rng.randint(args.min_prompt_words, args.max_prompt_words)
    start = rng.randrange(0, len(words) - n_words)
    prompt = " ".join(words[start : start + n_words])
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    leave_after = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < args.disconnect else None
    t0 = time.perf_counter()
    last = None
    chunks = 0
    try:
        stream = await client.completions.create(
            model=args.model, prompt=prompt, max_tokens=max_tokens, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        try:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    st.tokens += chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                chunks += 1
                if last is None:
                    st.ttft.append(now - t0)
                else:
                    st.itl.append(now - last)
                last = now
                if leave_after is not None and chunks >= leave_after:
                    st.disconnected += 1
                    st.tokens += chunks
                    return  # closing the stream below drops the connection mid-response
        finally:
            await stream.close()
        st.ok += 1
    except openai.APIStatusError as e:
        st.errors[str(e.status_code)] = st.errors.get(str(e.status_code), 0) + 1
    except Exception as e:  # a broken connection or a protocol error counts against the server
        st.errors[type(e).__name__] = st.errors.get(type(e).__name__, 0) + 1


async def run_clients(url: str, args: argparse.Namespace) -> tuple[Stats, float]:
    import openai

    words = load_words()
    st = Stats()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0,
                                timeout=args.request_timeout)
    deadline = time.perf_counter() + args.duration

    async def worker(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        while time.perf_counter() < deadline:
            await one_request(client, rng, words, args, st)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(args.clients)))
    finally:
        await client.close()
    return st, time.perf_counter() - t0


async def slow_client(port: int, kind: int, deadline: float, ss: SlowStats) -> None:
    """One unauthenticated client opening slow connections until ``deadline``."""
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(1)
            continue
        ss.connections += 1
        head = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Type: application/json\r\n",
                b"Content-Length: 4194304\r\n", b"\r\n"]

        async def trickle() -> None:
            parts = head[:-1] if kind == 0 else (head + [b"a" * 65536] * 64 if kind == 1 else [])
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(1.0)
            await asyncio.sleep(3600)

        sender = asyncio.create_task(trickle())
        try:
            first = await reader.readline()
            if first:
                ss.replies[first.decode().strip()] = ss.replies.get(first.decode().strip(), 0) + 1
            while await reader.read(65536):
                pass
        except OSError:
            pass
        finally:
            sender.cancel()
            writer.close()
        ss.lifetimes.append(time.perf_counter() - t0)


async def sample_rss(pid: int, stop: asyncio.Event, ss: SlowStats) -> None:
    while not stop.is_set():
        with open(f"/proc/{pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        ss.rss_mib.append(rss_kb / 1024)
        await asyncio.sleep(0.5)


async def run_all(url: str, args: argparse.Namespace, pid: int | None) -> tuple[Stats, float, SlowStats]:
    """The streaming clients, plus the slow clients and the RSS sampler when asked."""
    ss, stop = SlowStats(), asyncio.Event()
    port = int(url.rsplit(":", 1)[1])
    deadline = time.perf_counter() + args.duration
    extra = [asyncio.create_task(slow_client(port, i % 3, deadline, ss)) for i in range(args.slow_clients)]
    if pid is not None:
        extra.append(asyncio.create_task(sample_rss(pid, stop, ss)))
    try:
        st, wall = await run_clients(url, args)
    finally:
        stop.set()
        await asyncio.sleep(0.6)
        for t in extra:
            t.cancel()
        await asyncio.gather(*extra, return_exceptions=True)
    return st, wall, ss


def scrape(url: str, key: str | None) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


def settle(url: str, key: str | None, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url, key)
        busy = m["qpage:num_requests_running"] + m["qpage:num_requests_waiting"] + m["qpage:kv_cache_usage_perc"]
        if busy == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which clients start requests")
    ap.add_argument("--disconnect", type=float, default=0.25, help="share of requests dropped mid-stream")
    ap.add_argument("--min-prompt-words", type=int, default=8)
    ap.add_argument("--max-prompt-words", type=int, default=300)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-clients", type=int, default=0,
                    help="unauthenticated slow clients alongside (the started server then requires a key)")
    ap.add_argument("--server-args", default="--max-model-len 1024 --kv-cache-memory 512MiB --max-num-seqs 64",
                    help="arguments for the server this script starts")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve_load.json"))
    args = ap.parse_args()

    server = None
    url = args.url
    if args.slow_clients and not args.api_key:
        args.api_key = "serve-load-key"
    if url is None:
        from tests.server.conftest import start_server, stop_server

        log = Path(args.out).with_suffix(".server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        key = ["--api-key", args.api_key] if args.api_key else []
        server = start_server([*args.server_args.split(), *key, "--no-access-log"], log)
        url = server.url
    try:
        before = scrape(url, args.api_key)
        st, wall, ss = asyncio.run(run_all(url, args, server.proc.pid if server is not None else None))
        after = settle(url, args.api_key)
    finally:
        if server is not None:
            stop_server(server)
    report(args, st, wall, before, after, ss)


def report(args: argparse.Namespace, st: Stats, wall: float, before: dict[str, float], after: dict[str, float],
           ss: SlowStats) -> None:
    done = st.ok + st.disconnected
    res: dict[str, Any] = {
        "clients": args.clients, "duration_s": args.duration, "wall_s": wall, "disconnect_share": args.disconnect,
        "requests_completed": st.ok, "requests_disconnected": st.disconnected, "errors": st.errors,
        "requests_per_s": done / wall, "generated_tokens_per_s": st.tokens / wall,
        "server_generation_tokens": after["qpage:generation_tokens_total"] - before["qpage:generation_tokens_total"],
        "server_preemptions": after["qpage:num_preemptions_total"] - before["qpage:num_preemptions_total"],
        "final_kv_cache_usage": after["qpage:kv_cache_usage_perc"],
        "final_running": after["qpage:num_requests_running"], "final_waiting": after["qpage:num_requests_waiting"],
    }
    for name, xs in (("ttft_s", st.ttft), ("itl_s", st.itl)):
        for q in (0.5, 0.9, 0.99):
            res[f"{name}_p{int(q * 100)}"] = pct(xs, q)
    res.update({"slow_clients": args.slow_clients, "slow_connections": ss.connections,
                "slow_lifetime_p50_s": pct(ss.lifetimes, 0.5), "slow_lifetime_max_s": max(ss.lifetimes, default=None),
                "slow_replies": ss.replies, "server_rss_mib_first": ss.rss_mib[0] if ss.rss_mib else None,
                "server_rss_mib_max": max(ss.rss_mib, default=None)})
    ms = lambda v: "-" if v is None else f"{1000 * v:.0f}"  # noqa: E731
    print(f"\n{args.clients} streaming clients for {args.duration:.0f}s ({wall:.0f}s with the tail), "
          f"{100 * args.disconnect:.0f}% disconnecting mid-stream\n")
    print("| metric | value |\n|---|---:|")
    rows = [
        ("requests completed", st.ok), ("requests disconnected (intended)", st.disconnected),
        ("error responses", sum(st.errors.values())), ("requests/s", f"{res['requests_per_s']:.2f}"),
        ("generated tokens/s (client side)", f"{res['generated_tokens_per_s']:.1f}"),
        ("server generation tokens", int(res["server_generation_tokens"])),
        ("preemptions", int(res["server_preemptions"])),
        ("TTFT p50 / p90 / p99 (ms)", " / ".join(ms(res[f"ttft_s_p{q}"]) for q in (50, 90, 99))),
        ("ITL p50 / p90 / p99 (ms)", " / ".join(ms(res[f"itl_s_p{q}"]) for q in (50, 90, 99))),
        ("after: KV cache usage", after["qpage:kv_cache_usage_perc"]),
        ("after: running / waiting", f"{after['qpage:num_requests_running']:.0f} / "
                                     f"{after['qpage:num_requests_waiting']:.0f}"),
    ]
    if ss.rss_mib:
        rows.append(("server RSS first / max (MiB)", f"{ss.rss_mib[0]:.0f} / {max(ss.rss_mib):.0f}"))
    if args.slow_clients:
        life = " / ".join("-" if v is None else f"{v:.1f}" for v in (pct(ss.lifetimes, 0.5), max(ss.lifetimes,
                                                                                              default=None)))
        rows += [("slow clients: connections opened", ss.connections),
                 ("slow clients: connection lifetime p50 / max (s)", life),
                 ("slow clients: replies", ", ".join(f"{k} x{v}" for k, v in ss.replies.items()) or "-")]
    for k, v in rows:
        print(f"| {k} | {v} |")
    if st.errors:
        print(f"errors by kind: {st.errors}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    clean = not st.errors and after["qpage:kv_cache_usage_perc"] == 0 and after["qpage:num_requests_running"] == 0
    print("PASS: no errors, block pool all free" if clean else "FAIL: errors or blocks left in use")
    if not clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
