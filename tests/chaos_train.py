"""Chaos run for tests/test_train.py: DP training on a multi-node local Ray cluster, one node killed.

Run as a subprocess (it starts its own ``ray.cluster_utils.Cluster``, which
must not meet the session cluster in the test process)::

    python tests/chaos_train.py WORK_DIR DATA_PATH BASE_PATH

The environment must carry ``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``
and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (every node on 127.0.0.1).
The head has no CPUs (the driver and the Ray Train controller, which is
pinned to the driver's node, live there); three 1-CPU worker nodes host
the two training workers and a spare. The victim is a node with a training
worker but not the ledger actor (which may land on any node; it would
survive anyway, restarted from its log, but that is another test): with
two training nodes there is always one. Once Ray Train has registered a checkpoint (its controller collects
reports every couple of seconds: a checkpoint reported just before a crash
is lost, and the restart would begin from an older one) and rank 0 has
applied ``KILL_MARGIN`` more steps, the node of a training worker is killed
without grace. The result (the release summary, the audit log of applied
steps, the step the kill followed) is written to ``WORK_DIR/result.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

STEPS = 40
CHECKPOINT_EVERY = 4
KILL_MARGIN = 2
NOISE = 1.0
BUDGET = 200.0


def _audit_lines(storage: Path) -> list[dict]:
    lines: list[dict] = []
    for path in storage.glob("*.applied_steps.jsonl"):
        lines += [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines


def _registered_step(storage: Path) -> int | None:
    """Step of the latest checkpoint the Ray Train controller has registered, if any."""
    for path in storage.glob("*/checkpoint_manager_snapshot.json"):
        try:
            latest = json.loads(path.read_text(encoding="utf-8")).get("latest_checkpoint_result")
        except (OSError, ValueError):
            continue
        if latest:
            return int(latest["metrics"]["step"])
    return None


def _victim(cluster) -> object | None:
    """A worker node hosting a training worker but not the ledger (nor the controller)."""
    # The GCS actor table: the state API would need a dashboard on the head.
    from ray._private.state import actors as actor_table

    alive = [a for a in actor_table().values() if a.get("State") == "ALIVE"]
    train_nodes = {a["Address"]["NodeID"] for a in alive if a["ActorClassName"] == "RayTrainWorker"}
    critical = {
        a["Address"]["NodeID"]
        for a in alive
        if a["ActorClassName"] in ("TrainController", "StoreLedgerActor")
    }
    for node in list(cluster.worker_nodes):
        if node.node_id in train_nodes and node.node_id not in critical:
            return node
    return None


def main() -> int:
    work, data, base = (Path(a) for a in sys.argv[1:4])
    import ray
    from ray.cluster_utils import Cluster

    from privcode.cluster.local import LOOPBACK, connect
    from privcode.cluster.ray_env import ensure_token
    from privcode.config import TrainConfig
    from privcode.privacy.budget import init_store
    from privcode.train.run import run_training

    ensure_token()
    temp = work / "ray"
    # Cluster.add_node writes ray_current_cluster under Ray's default temp dir even when
    # the head's temp_dir is elsewhere: on a machine that never ran Ray, it does not exist.
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "temp_dir": str(temp),
        },
    )
    result: dict = {
        "killed": None,
        "constants": {
            "steps": STEPS,
            "noise": NOISE,
            "budget": BUDGET,
            "checkpoint_every": CHECKPOINT_EVERY,
        },
    }
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        cluster.wait_for_nodes()
        connect(cluster.address)
        cfg = TrainConfig(
            method="privcode++",
            latent_dim=16,
            num_virtual_tokens=4,
            align_bank_size=8,
            steps=STEPS,
            checkpoint_every=CHECKPOINT_EVERY,
            num_workers=2,
            expected_batch_size=8,
            noise_multiplier=NOISE,
            epsilon=BUDGET,
            max_length=48,
            eval_tokens=0,
            max_failures=2,
            lr=1e-3,
        )
        storage = work / "storage"
        outcome: dict = {}

        def train() -> None:
            try:
                outcome["summary"] = run_training(
                    cfg,
                    data_path=data,
                    base_path=base,
                    out_dir=work / "release",
                    run_name="chaos",
                    storage_dir=storage,
                    keep_storage=True,
                    privacy_store=init_store(work / "privacy-store")[0].root,
                ).summary.to_json()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                outcome["error"] = "".join(traceback.format_exception(exc))

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        deadline = time.time() + 240
        while thread.is_alive() and time.time() < deadline and result["killed"] is None:
            registered = _registered_step(storage)
            applied = len(_audit_lines(storage))
            result["last_seen"] = {"registered_step": registered, "applied": applied}
            if registered is not None and applied >= registered + KILL_MARGIN:
                victim = _victim(cluster)
                if victim is not None:
                    result["killed"] = {
                        "node_id": victim.node_id,
                        "after_applied": applied,
                        "registered_step": registered,
                    }
                    cluster.remove_node(victim, allow_graceful=False)
            time.sleep(0.05)
        thread.join(timeout=max(1.0, deadline - time.time()))
        result.update(outcome)
        result["applied"] = _audit_lines(storage)
        result["timed_out"] = thread.is_alive()
    except BaseException as exc:
        result["driver_error"] = "".join(traceback.format_exception(exc))
        raise
    finally:
        (work / "result.json").write_text(json.dumps(result, default=str), encoding="utf-8")
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    # The controller polls workers (reports, health) at this interval: shorter
    # than the default 2 s so a checkpoint is registered, and a dead node
    # noticed, within a few of the (fast) steps of the tiny model.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    sys.exit(main())
