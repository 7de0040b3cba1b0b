"""Stage II on Ray's fake multi-node autoscaling cluster: worker nodes come and go with the pools.

The head has no CPUs and the cluster starts with no worker nodes; the autoscaler (v1, Ray's
``fake_multinode`` provider, as ``ray.cluster_utils.AutoscalingCluster`` sets it up) adds 1-CPU
worker nodes as Stage II's actor pools ask for them, the run finishes, and the idle nodes are
removed after ``idle_timeout_minutes``: what the chart's autoscaled synthesis does on KubeRay
(docs/kubernetes.md, "Autoscaled synthesis"). About 80 s on 2 cores.

The cluster and the driver run in a subprocess (this file run as a script), on their own free
ports of 127.0.0.1, temp dir and token: the session's Ray head is never touched. Not
``AutoscalingCluster`` itself: its ``start``/``shutdown`` run ``ray stop --force`` (every Ray
process of the user, other heads included) and the wheel lacks the ``example.yaml`` its
constructor reads; :class:`FakeAutoscalingHead` does the rest of what it does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

WORKER_TYPE = "cpu"
MAX_WORKERS = 4
IDLE_TIMEOUT_MINUTES = 0.1  # 6 s
NUM_SAMPLES = 96
# Seconds per generated sample: a backlog builds up before the generator, and Ray Data may ask
# the autoscaler for a second generator actor (a node more) before the run ends.
GENERATE_DELAY_S = 0.25


class FakeAutoscalingHead:
    """A Ray head on 127.0.0.1 whose autoscaler launches fake worker nodes on this machine.

    What ``ray.cluster_utils.AutoscalingCluster`` (autoscaler v1) does, on ports of our choice,
    with token auth (:func:`privcode.cluster.local.start_head`) and stopped by port
    (:func:`~privcode.cluster.local.stop_head`): the fake nodes are the monitor's children and
    share the head's session dir, so they stop with it.
    """

    def __init__(self, base: Path, worker_cpus: float, max_workers: int, idle_minutes: float):
        from privcode.cluster import local

        self.base = base
        self.port, self.dashboard_port = local.free_port(), local.free_port()
        self.address = f"{local.LOOPBACK}:{self.port}"
        worker = {"CPU": worker_cpus, "object_store_memory": 200 * 2**20}
        # Ray's fake_multi_node/example.yaml (not in the wheel) with our node types.
        self.config = {
            "cluster_name": "fake_multinode",
            "max_workers": max_workers,
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": self.address,  # else node IP:6379
            },
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
                WORKER_TYPE: {
                    "resources": worker,
                    "node_config": {},
                    "min_workers": 0,
                    "max_workers": max_workers,
                },
            },
            "head_node_type": "ray.head.default",
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_minutes,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }

    def start(self) -> dict[str, Any]:
        from privcode.cluster import local

        path = self.base / "autoscaling.json"
        path.write_text(json.dumps(self.config))
        # As AutoscalingCluster.start: the provider refuses to run without RAY_FAKE_CLUSTER;
        # the monitor (and the fake nodes it starts) inherit the head's environment.
        os.environ.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        return local.start_head(
            port=self.port,
            dashboard_port=self.dashboard_port,
            num_cpus=0,
            temp_dir=self.base / "ray",
            wait_s=120,
            extra_args=[f"--autoscaling-config={path}"],
        )

    def shutdown(self) -> list[int]:
        """Stop every process of the cluster; the pids still alive 10 s later."""
        import psutil

        from privcode.cluster import local

        procs = local.head_processes(self.port)  # the fake nodes' too: the monitor's children
        local.stop_head(self.port)
        return [p.pid for p in psutil.wait_procs(procs, timeout=10)[1]]


def worker_nodes() -> list[str]:
    """Alive nodes with CPUs: the fake workers (the head has none)."""
    import ray

    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


class NodeWatch:
    """Polls the alive worker nodes every 0.5 s from a thread: ``[(seconds, count), ...]``
    at each change."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.timeline: list[tuple[float, int]] = []
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                nodes = worker_nodes()
                self.seen.update(nodes)
                if not self.timeline or self.timeline[-1][1] != len(nodes):
                    self.timeline.append((round(time.monotonic() - self.t0, 1), len(nodes)))
            self._stop.wait(0.5)

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def current(self) -> int:
        return self.timeline[-1][1] if self.timeline else 0


class SlowCannedGenerate:
    """Stand-in generator (as bench/bench_synth.py's): public stdlib functions by sample index,
    renamed per sample, no model; ``GENERATE_DELAY_S`` per sample."""

    record_dir = ""  # set by the script (pickled with the class): one file per actor

    def __init__(self, release_path, options, public_prompts):
        import ray

        from privcode.data.public import public_pairs

        self.codes = [c for _, c in public_pairs(200, seed=11)]
        node = ray.get_runtime_context().get_node_id()
        Path(self.record_dir, f"{os.getpid()}.node").write_text(node)

    def __call__(self, batch):
        import re

        import numpy as np

        time.sleep(GENERATE_DELAY_S * len(batch["index"]))
        codes = [
            re.sub(r"\b(def|class) (\w+)", rf"\1 \2_{i}", self.codes[i % len(self.codes)], count=1)
            for i in map(int, batch["index"])
        ]
        return {
            **batch,
            "code": np.array(codes, dtype=object),
            "cond_prompt": np.array([""] * len(codes), dtype=object),
        }


def _wait(predicate, timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# --------------------------------------------------------------------------- the driver script


def main(argv: list[str] | None = None) -> None:
    """Start the autoscaling head, run Stage II on it, wait for the idle nodes to go; writes
    a JSON summary (worker nodes over time, seconds, the run's counts) to ``--out``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--release", required=True)
    ap.add_argument("--base", required=True, help="this cluster's dir (short: socket paths)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below still runs
    base = Path(args.base)
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN"):
        os.environ.pop(key, None)  # nothing of the session head
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(base / "auth_token"))

    from privcode.cluster import local, ray_env
    from privcode.config import SynthConfig
    from privcode.synth.pipeline import run_synthesis

    ray_env.ensure_token()
    head = FakeAutoscalingHead(base, 1.0, MAX_WORKERS, IDLE_TIMEOUT_MINUTES)
    (base / "port").write_text(str(head.port))  # the test stops the head by port if we die
    cfg = SynthConfig(
        num_samples=NUM_SAMPLES,
        shard_size=32,
        batch_size=8,
        generators_min=1,
        generators_max=2,
        cpus_per_generator=1.0,  # a whole worker node per generator actor
        sandbox_workers=2,
    )
    SlowCannedGenerate.record_dir = str(base / "generators")
    os.mkdir(SlowCannedGenerate.record_dir)
    summary: dict[str, Any] = {"port": head.port}
    started = time.monotonic()
    try:
        head.start()
        summary["head_seconds"] = round(time.monotonic() - started, 1)
        local.connect(head.address, log_to_driver=False)
        with NodeWatch() as watch:
            time.sleep(5)  # a few autoscaler rounds (1 s each): min_workers 0 launches nothing
            summary["workers_at_start"] = watch.current
            t0 = time.monotonic()
            result = run_synthesis(
                cfg,
                release=args.release,
                out_dir=base / "out",
                work_root=base / "work",
                progress=False,
                generator=SlowCannedGenerate,
            )
            summary["run_seconds"] = round(time.monotonic() - t0, 1)
            summary["workers_at_run_end"] = watch.current
            t1 = time.monotonic()
            summary["idle_removed"] = _wait(lambda: watch.current == 0, 180)
            summary["idle_removal_seconds"] = round(time.monotonic() - t1, 1)
        counts = watch.timeline
        monitor_log = base / "ray" / "session_latest" / "logs" / "monitor.log"
        events = [
            line.split(":event_summary:", 1)[1].strip()
            for line in monitor_log.read_text(errors="replace").splitlines()
            if ":event_summary:" in line
        ]
        summary.update(
            timeline=counts,
            max_workers=max(c for _, c in counts),
            workers_at_end=watch.current,
            nodes_launched=len(watch.seen),
            generator_nodes=sorted(
                {p.read_text()[-5:] for p in Path(SlowCannedGenerate.record_dir).iterdir()}
            ),
            generated=result["generated"],
            kept=result["kept"],
            shards_written=result["shards_written"],
            autoscaler_events=events,  # the monitor's "Adding ..." / "Removing ... (idle)"
        )
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        summary["leftover_pids"] = head.shutdown()
        summary["total_seconds"] = round(time.monotonic() - started, 1)
        Path(args.out).write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)


# --------------------------------------------------------------------------- the test

SCRIPT_TIMEOUT_S = 420


def _light_release(root: Path) -> Path:
    """A verified DP release whose adapter is a stand-in LoRA tensor (no model is loaded)."""
    import numpy as np
    from conftest import privacy_record
    from safetensors.numpy import save_file

    from privcode.train.release import write_release

    adapter = root / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    save_file(
        {"base_model.model.lm_head.lora_A.weight": np.zeros((2, 4), dtype=np.float32)},
        str(adapter / "adapter_model.safetensors"),
    )
    meta = {"method": "privcode", "conditioning": "prompt", "dp": True, "base_model": "unused"}
    return write_release(
        root / "release", adapter_dir=adapter, meta=meta, privacy=privacy_record(epsilon=4.0)
    )


def _stop(base: Path) -> list[int]:
    """Stop the script's head if it is still up; the pids of its processes still alive after."""
    import psutil

    from privcode.cluster import local

    with contextlib.suppress(OSError, ValueError):
        port = int((base / "port").read_text())
        before = local.head_processes(port)
        local.stop_head(port)
        psutil.wait_procs(before, timeout=10)
        return [p.pid for p in before if p.is_running()]
    return []


@pytest.mark.ray  # its own Ray cluster, not the session's: out of `make test-fast`
def test_synthesis_grows_worker_nodes_from_zero_and_idle_ones_are_removed(tmp_path):
    """Head with 0 CPUs, no workers: the actor pools' requests add nodes (more than one), the
    run generates every sample, and the idle nodes are removed back to 0 afterwards."""
    release = _light_release(tmp_path)
    base = Path(tempfile.mkdtemp(prefix="pcas-", dir="/tmp"))  # short: Unix socket paths
    out = base / "summary.json"
    cmd = [sys.executable, __file__, "--release", str(release), "--base", str(base)]
    proc = subprocess.Popen(
        [*cmd, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            log, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: its finally stops the cluster
            log, _ = proc.communicate(timeout=90)
        summary = json.loads(out.read_text()) if out.is_file() else {}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = _stop(base)
        shutil.rmtree(base, ignore_errors=True)
    tail = f"summary {summary}\n--- script output (tail) ---\n{log[-6000:]}"
    assert proc.returncode == 0, tail
    leftovers += summary.get("leftover_pids", [])
    assert not leftovers, f"the autoscaling cluster left processes behind: {leftovers}"
    assert summary["workers_at_start"] == 0, tail
    assert summary["max_workers"] >= 2, tail  # a generator node + a filter node at least
    assert summary["generated"] == NUM_SAMPLES and summary["shards_written"] == NUM_SAMPLES // 32, (
        tail
    )
    assert 0 < summary["kept"] <= NUM_SAMPLES, tail
    assert summary["idle_removed"] and summary["workers_at_end"] == 0, tail
    removals = [e for e in summary["autoscaler_events"] if e.startswith("Removing")]
    assert removals and all("(idle)" in e for e in removals), tail
    print(json.dumps(summary))  # the measured numbers, for `pytest -s`


if __name__ == "__main__":
    main()
