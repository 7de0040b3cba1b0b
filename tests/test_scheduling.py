"""The runner's admission rule: a stage starts beside others only while CPU footprints fit."""

from __future__ import annotations

import pytest

from privcode.artifacts import StageManifest
from privcode.config import load_config
from privcode.pipeline import runner
from privcode.pipeline.stages import STAGES, PendingInput


@pytest.fixture()
def two_cpus(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})


def _running(*names):
    return {object(): (n, "fp", 0.0) for n in names}


def test_footprints_count_the_workers_a_stage_starts():
    cfg = load_config(
        "jobs/configs/demo.yaml",
        ["train.num_workers=3", "train.cpus_per_worker=2", "premium.num_workers=2"],
    )
    assert STAGES["train"].cpus(cfg) == 0  # the stage task only drives Ray Train ...
    assert STAGES["train"].footprint(cfg) == 6  # ... whose workers hold the CPUs
    assert STAGES["premium"].footprint(cfg) == 2 * cfg.premium.cpus_per_worker
    from privcode.synth.pipeline import FILTER_CPUS

    assert STAGES["synth"].footprint(cfg) == pytest.approx(
        cfg.synth.generators_max * cfg.synth.cpus_per_generator + FILTER_CPUS
    )  # may grow to max
    # Audits in 1-CPU model tasks that queue for CPUs: starts once one of them fits.
    assert STAGES["audit"].cpus(cfg) == 0 and STAGES["audit"].footprint(cfg) == 1
    one_after_another = load_config("jobs/configs/demo.yaml", ["audit.cpus_per_model=0"])
    assert STAGES["audit"].footprint(one_after_another) is None  # the whole cluster
    inline_nondp = load_config(
        "jobs/configs/demo.yaml",
        ["run.stages=[data, base, train, audit]", "audit.compare_nondp=true"],
    )
    assert STAGES["audit"].cpus(inline_nondp) is None  # trains the comparison in its task
    assert STAGES["pac"].footprint(cfg) == cfg.pac.num_cpus == 1
    # Ray Train's local mode (the demo's num_workers 0): the stage task itself trains.
    demo = load_config("jobs/configs/demo.yaml")
    for stage, section in (("train", demo.train), ("premium", demo.premium)):
        assert section.num_workers == 0
        assert STAGES[stage].cpus(demo) == STAGES[stage].footprint(demo) == 1
    assert (
        STAGES["pac"].footprint(load_config("jobs/configs/demo.yaml", ["pac.num_cpus=0"])) is None
    )


def test_demo_runs_two_lanes_on_two_cpus(two_cpus):
    """Stage I and II on one core, pac then nondp on the other; nothing oversubscribes."""
    cfg = load_config("jobs/configs/demo.yaml")
    assert runner._fits(STAGES["pac"], cfg, _running("train"))
    # Ray Train's workers are counted before they exist: no third 1-CPU stage beside train.
    assert not runner._fits(STAGES["nondp"], cfg, _running("train", "pac"))
    assert runner._fits(STAGES["synth"], cfg, _running("pac"))
    assert runner._fits(STAGES["nondp"], cfg, _running("synth"))
    assert runner._fits(STAGES["premium"], cfg, _running("nondp"))
    assert runner._fits(STAGES["audit"], cfg, _running("eval"))  # the audits start beside eval
    # A stage asking for the whole cluster waits for everything, and blocks everything.
    cfg = load_config("jobs/configs/demo.yaml", ["audit.cpus_per_model=0"])
    assert not runner._fits(STAGES["audit"], cfg, _running("pac"))
    assert not runner._fits(STAGES["pac"], cfg, _running("audit"))


def test_audit_starts_beside_the_premium_training_and_waits_for_it_inside():
    """Stage.late: the audit is ready while premium runs, and gets premium as a pending input."""
    order = ["data", "base", "train", "synth", "premium", "nondp", "audit"]
    done = {n: StageManifest(n, n, {}) for n in ("data", "base", "train", "synth", "nondp")}
    ref = object()
    running = {ref: ("premium", "fp-premium", 0.0)}
    assert runner._ready("audit", order, done, running)
    assert not runner._ready("audit", order, done)  # premium neither done nor running
    assert not runner._ready("eval", order, done, running)  # eval is not late for premium
    late = runner._late_inputs(STAGES["audit"], running)
    assert late == {"premium": PendingInput("fp-premium", ref)}
    # The fingerprint is the same whether premium is still running or done.
    cfg = load_config("jobs/configs/demo.yaml")
    finished = {**done, "premium": StageManifest("premium", "fp-premium", {})}
    assert runner.fingerprint(cfg, STAGES["audit"], {**done, **late}) == runner.fingerprint(
        cfg, STAGES["audit"], finished
    )
    assert set(STAGES["audit"].late) <= set(STAGES["audit"].after)
    assert all(set(s.late) <= set(s.after) for s in STAGES.values())


def test_wait_input_returns_the_upstream_manifest_or_its_error(ray_connected):
    import ray

    from privcode.errors import PrivcodeError
    from privcode.pipeline.stages import wait_input

    premium, data = StageManifest("premium", "f", {"x": 1}), StageManifest("data", "d", {})
    inputs = {"premium": PendingInput("f", ray.put(premium)), "data": data}
    assert wait_input(inputs, "premium") == premium
    assert inputs["premium"] == premium  # resolved once
    assert wait_input(inputs, "data") == data and wait_input(inputs, "x") is None

    @ray.remote
    def fails():
        raise PrivcodeError("premium: too few kept samples")

    with pytest.raises(PrivcodeError, match="too few kept samples"):
        wait_input({"premium": PendingInput("f", fails.remote())}, "premium")


def test_a_whole_node_stage_asks_for_one_node_not_the_cluster():
    """Head with 0 CPUs and two 1-CPU workers: 2 CPUs in the cluster, 1 on any node. A stage
    that wants a whole node gets 1 (asking for 2 would never be placed)."""
    from privcode.pipeline.runner import largest_node_cpus

    nodes = [
        {"Alive": True, "Resources": {"memory": 1e9}},  # the head: 0 CPUs
        {"Alive": True, "Resources": {"CPU": 1.0}},
        {"Alive": True, "Resources": {"CPU": 1.0}},
        {"Alive": False, "Resources": {"CPU": 16.0}},  # gone
    ]
    assert largest_node_cpus(nodes) == 1.0
    assert largest_node_cpus([{"Alive": True, "Resources": {"CPU": 4.0}}, nodes[1]]) == 4.0
    assert largest_node_cpus([]) == 0.0


MULTI_NODE = """
import json, sys
import ray
from ray.cluster_utils import Cluster
from privcode.config import load_config
from privcode.pipeline.runner import run_pipeline

root, cache = sys.argv[1], sys.argv[2]
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
            "dashboard_host": "127.0.0.1"})
for _ in range(2):
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
try:
    cfg = load_config("jobs/configs/demo.yaml", [
        f"run.out_dir={root}/runs", f"run.reports_dir={root}/reports", "run.name=mn",
        f"run.ray_address={c.address}", "run.stages=[data, base]", "data.size=60",
        "data.canary_repetitions=[1]", "data.canary_kinds=[email]", "base.preset=ci",
        f"base.cache_dir={cache}",
    ])
    result = run_pipeline(cfg)
    print(json.dumps({n: r["status"] for n, r in result["stages"].items()}))
finally:
    ray.shutdown()
    c.shutdown()
"""


@pytest.mark.heavy
def test_whole_node_stages_are_placed_on_a_multi_node_cluster(tmp_path, ci_base_cache):
    """A head with 0 CPUs and two 1-CPU workers (ray.cluster_utils.Cluster, 127.0.0.1): the
    base stage, which wants a whole node, runs. Asking for the cluster's 2 CPUs in one task
    (as before) was never placed: the run waited forever."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-c", MULTI_NODE, str(tmp_path), ci_base_cache],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"data": "ran", "base": "ran"}
