"""Serving under load, on 127.0.0.1 only: latency and throughput of both apps through Ray Serve.

Run::

    .venv/bin/python bench/bench_serve.py [--clients 1 8 32] [--requests 64] [--max-tokens 16]
                                          [--worlds 8] [--preset demo] [--cache-dir DIR]
                                          [--premium DIR] [--pac-worlds DIR]
                                          [--pac-clients 1 8] [--rounds 2] [--pac-cpus 1]

Starts a local Ray cluster and Ray Serve on 127.0.0.1, deploys the premium app and the PAC
ensemble (the real apps: FastAPI ingress, API keys, rate limits, the curator's store), and
drives them with an asyncio HTTP client (aiohttp) on the same loopback:

* premium: ``--requests`` completions (``max_tokens`` tokens each, greedy and sampled mixed)
  at each of ``--clients`` concurrent clients;
* PAC at m = ``--worlds``: the same at 1 and 8 clients (``--pac-clients``; one replica's
  decode thread steps its requests together), the settings taking ``--rounds`` turns, and
  the ratio of their median requests/s;
* then one burst past a tight rate limit, to show the 429s come back at once.

Prints, per setting, p50 / p99 latency (ms), requests/s, completion tokens/s and the count of
non-200 answers (expected: 0 below the rate limit). Without ``--premium`` / ``--pac-worlds`` it
builds a throwaway release and worlds over the preset's public base (random LoRA adapters:
the cost does not depend on the weights). Numbers: docs/benchmarks.md, "Serving".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

KEY = "bench-key-" + "0123456789abcdef" * 2
PROMPTS = [
    "def add(a, b):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "# parse a config file\n",
]


def make_release(base: str, root: Path) -> Path:
    """A premium release (LoRA adapter + premium.json) over ``base``."""
    import torch

    from privcode.models.loading import attach_lora, load_causal_lm

    model = attach_lora(load_causal_lm(base), r=8, alpha=16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(root / "adapter"))
    # No data at all went into this adapter (random weights): nothing private to protect.
    privacy = {
        "dp": True,
        "dp_training": False,
        "epsilon": None,
        "delta": None,
        "guarantee": "benchmark: a random adapter, trained on no data",
        "no_dp_guarantee": False,
        "privacy_warning": None,
        "post_processing_of": {"release_sha256": "none", "dp": True},
        "statement": "benchmark release: random LoRA weights, no data",
    }
    meta = {
        "model": base,
        "data": "none",
        "data_sha256": "0" * 64,
        "records": 0,
        "curve": [],
        "config": {},
        "train_seconds": 0.0,
        "privacy": privacy,
    }
    (root / "premium.json").write_text(json.dumps(meta))
    return root


async def drive(url: str, bodies: list[dict], clients: int) -> dict:
    """Send ``bodies`` with ``clients`` concurrent connections; latencies and statuses."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    tokens = 0
    headers = {"Authorization": f"Bearer {KEY}"}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            async with session.post(url, json=body, headers=headers) as resp:
                data = await resp.json()
            latencies.append(time.perf_counter() - t0)
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status == 200:
                tokens += data["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=600)
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "p50": statistics.median(lat) * 1e3,
        "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        "rps": len(lat) / wall,
        "tokens_s": tokens / wall,
        "errors": sum(n for s, n in statuses.items() if s != 200),
        "statuses": statuses,
    }


def bodies(n: int, max_tokens: int, pac: bool = False) -> list[dict]:
    out = []
    for i in range(n):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens}
        if i % 2 and not pac:
            body.update(temperature=0.8, top_p=0.95)
        out.append(body)
    return out


def row(app: str, setting: str, r: dict) -> None:
    print(
        f"{app:<8} {setting:<22} {r['p50']:>9.1f} {r['p99']:>9.1f} {r['rps']:>8.2f} "
        f"{r['tokens_s']:>9.1f} {r['errors']:>7}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--pac-clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=64, help="Requests per setting.")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--worlds", type=int, default=8, help="m of the PAC ensemble.")
    ap.add_argument("--preset", default="demo", help="Base-model preset (ci, demo, small).")
    ap.add_argument("--cache-dir", help="Base-model cache (default: base.cache_dir's default).")
    ap.add_argument("--premium", help="A premium release dir (default: a throwaway one).")
    ap.add_argument("--pac-worlds", help="A PAC worlds dir (default: throwaway m worlds).")
    ap.add_argument("--rounds", type=int, default=2, help="PAC settings' turns (medians).")
    ap.add_argument(
        "--pac-cpus", type=int, default=1, help="CPUs (and torch threads) of the PAC replica."
    )
    ap.add_argument("--burst", type=int, default=20, help="Requests past a limit of 2/s, 5 burst.")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_pac import make_worlds
    from ray import serve

    from privcode.cluster.local import connect, free_port
    from privcode.config import BaseConfig
    from privcode.models.base import build_base
    from privcode.privacy.budget import init_store
    from privcode.serve.ensemble import build_app as pac_app
    from privcode.serve.premium import build_app as premium_app

    base_cfg = BaseConfig(
        preset=args.preset, **({"cache_dir": args.cache_dir} if args.cache_dir else {})
    )
    os.environ["PRIVCODE_BENCH_SERVE_KEY"] = KEY
    with tempfile.TemporaryDirectory(prefix="privcode-bench-serve-") as tmp:
        work = Path(tmp)
        base = build_base(base_cfg, progress=False)["path"]
        release = Path(args.premium) if args.premium else make_release(base, work / "premium")
        worlds = (
            Path(args.pac_worlds)
            if args.pac_worlds
            else make_worlds(base, args.worlds, work / "runs" / "b" / "pac" / "worlds")
        )
        # A cluster of its own on 127.0.0.1 (a joined one may already run Serve elsewhere).
        os.environ.pop("RAY_ADDRESS", None)
        connect(None, num_cpus=2 + args.pac_cpus)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        env = {"env_vars": {"PRIVCODE_BENCH_SERVE_KEY": KEY, "OMP_NUM_THREADS": "1"}}
        threads = {"OMP_NUM_THREADS": str(args.pac_cpus)}
        pac_env = {"env_vars": {**env["env_vars"], **threads}}
        common = {"device": "cpu", "api_key_env": "PRIVCODE_BENCH_SERVE_KEY"}
        fast = {**common, "rate_limit_rps": 1e4, "rate_limit_burst": 10_000}
        serve.run(
            premium_app(
                {"premium": str(release), "max_batch_size": 8, **fast},
                ray_actor_options={"num_cpus": 1, "runtime_env": env},
            ),
            name="premium",
            route_prefix="/premium",
        )
        serve.run(
            pac_app(
                {
                    "worlds": str(worlds),
                    "privacy_store": str(init_store(work / "store")[0].root),
                    "deployment_budget": 1.0,
                    "session_budget": 1.0,
                    "key_budget_share": 1.0,
                    **fast,
                },
                ray_actor_options={"num_cpus": args.pac_cpus, "runtime_env": pac_env},
            ),
            name="pac",
            route_prefix="/ensemble",
        )
        print(
            f"bench_serve: base {args.preset}; {args.requests} requests per setting, "
            f"max_tokens {args.max_tokens}; Ray Serve on 127.0.0.1, one replica per app"
        )
        print(
            f"{'app':<8} {'setting':<22} {'p50 ms':>9} {'p99 ms':>9} {'req/s':>8} "
            f"{'tokens/s':>9} {'errors':>7}"
        )
        premium_url = f"{url}/premium/v1/completions"
        asyncio.run(drive(premium_url, bodies(4, 2), 2))  # warm-up: first batch, model load
        for c in args.clients:
            r = asyncio.run(drive(premium_url, bodies(args.requests, args.max_tokens), c))
            row("premium", f"{c} clients", r)
        pac_url = f"{url}/ensemble/v1/completions"
        asyncio.run(drive(pac_url, bodies(2, 2, pac=True), 1))
        rates: dict[int, list[float]] = {c: [] for c in args.pac_clients}
        for _ in range(args.rounds):  # settings take turns: a load that comes and goes hits all
            for c in args.pac_clients:
                r = asyncio.run(drive(pac_url, bodies(args.requests, args.max_tokens, True), c))
                row("pac", f"m={args.worlds}, {c} clients", r)
                rates[c].append(r["rps"])
        one = statistics.median(rates[args.pac_clients[0]])
        for c in args.pac_clients[1:]:
            print(
                f"pac {c} clients / {args.pac_clients[0]}: "
                f"{statistics.median(rates[c]) / one:.2f}x requests/s (medians of {args.rounds})"
            )
        # Past a tight limit: the guard answers 429 before the model sees the request.
        serve.run(
            premium_app(
                {"premium": str(release), **common, "rate_limit_rps": 2.0, "rate_limit_burst": 5},
                ray_actor_options={"num_cpus": 1, "runtime_env": env},
            ),
            name="premium",
            route_prefix="/premium",
        )
        r = asyncio.run(drive(premium_url, bodies(args.burst, args.max_tokens), 8))
        limited = r["statuses"].get(429, 0)
        print(
            f"rate limit 2/s burst 5: {args.burst} requests at once -> "
            f"{r['statuses'].get(200, 0)} x 200, {limited} x 429 (p50 {r['p50']:.1f} ms)"
        )
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
