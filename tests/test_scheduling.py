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


# ray.nodes() of the simulated cluster: a head with 0 CPUs and two 1-CPU workers (plus gone).
HEAD, CPU1 = (
    {"Alive": True, "Resources": {"memory": 1e9}},
    {"Alive": True, "Resources": {"CPU": 1.0}},
)
GONE = {"Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}}
MULTI = [HEAD, CPU1, CPU1, GONE]
GPU_NODE = {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}}
BIG_CPU = {"Alive": True, "Resources": {"CPU": 16.0}}


def _demo(*overrides):
    return load_config("jobs/configs/demo.yaml", list(overrides))


def test_a_whole_node_stage_asks_for_one_node_not_the_cluster():
    """Head with 0 CPUs and two 1-CPU workers: 2 CPUs in the cluster, 1 on any node. A stage
    that wants a whole node gets 1 (asking for 2, as main did, was never placed)."""
    from privcode.pipeline.placement import largest_node_cpus, stage_resources

    assert largest_node_cpus(MULTI) == 1.0
    assert largest_node_cpus([{"Alive": True, "Resources": {"CPU": 4.0}}, CPU1]) == 4.0
    assert largest_node_cpus([]) == 0.0
    cfg = _demo()
    assert stage_resources(STAGES["base"], cfg, MULTI) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert stage_resources(STAGES["base"], cfg, [*MULTI, BIG_CPU]) == {
        "num_cpus": 16.0,
        "num_gpus": 0.0,
    }
    # A CPU-only whole-node stage is sized to leave the GPU nodes to the GPU stages.
    assert stage_resources(STAGES["base"], cfg, [CPU1, GPU_NODE])["num_cpus"] == 1.0
    assert stage_resources(STAGES["base"], cfg, [HEAD, GPU_NODE])["num_cpus"] == 8.0
    for name in STAGES:  # the demo's every stage is placeable on the simulated cluster
        assert stage_resources(STAGES[name], cfg, MULTI)["num_cpus"] <= 1.0


def test_gpu_stages_reserve_a_gpu_on_a_node_that_has_one():
    from privcode.pipeline.placement import stage_resources

    nodes = [*MULTI, BIG_CPU, GPU_NODE]
    on = {"num_cpus": 1.0, "num_gpus": 1.0}
    assert stage_resources(STAGES["eval"], _demo("eval.use_gpu=true"), nodes) == on
    assert stage_resources(STAGES["eval"], _demo(), nodes) == {"num_cpus": 1.0, "num_gpus": 0.0}
    # A whole-node GPU stage takes the CPUs of a node with a GPU (8), not the largest (16).
    one_group = _demo("pac.use_gpu=true", "pac.num_cpus=0")
    assert stage_resources(STAGES["pac"], one_group, nodes) == {"num_cpus": 8.0, "num_gpus": 1.0}
    # 4 world groups train in their own tasks, a GPU each: the stage's task holds none ...
    groups = _demo("pac.use_gpu=true", "pac.world_groups=4")
    assert stage_resources(STAGES["pac"], groups, nodes)["num_gpus"] == 0.0
    # ... then the evaluation runs in a one-GPU task of its own.
    assert [(w.count, w.gpus) for w in STAGES["pac"].workers(groups)] == [(4, 1.0), (1, 1.0)]
    assert STAGES["pac"].gpu_footprint(groups) == 5.0
    # Inline audits hold the GPU; audits in per-model tasks (cpus_per_model) do not.
    inline = _demo("audit.use_gpu=true", "audit.cpus_per_model=0")
    assert stage_resources(STAGES["audit"], inline, nodes) == {"num_cpus": 8.0, "num_gpus": 1.0}
    per_model = _demo("audit.use_gpu=true")
    assert stage_resources(STAGES["audit"], per_model, nodes)["num_gpus"] == 0.0
    assert [(w.count, w.cpus, w.gpus) for w in STAGES["audit"].workers(per_model)] == [
        (3, 1.0, 1.0)  # junior, premium, nondpft
    ]
    # The non-DP comparison trains on train.use_gpu's device (privcode.train.nondp).
    gpu_train = _demo("train.use_gpu=true", "train.num_workers=2")
    assert stage_resources(STAGES["nondp"], gpu_train, nodes) == on
    assert STAGES["nondp"].gpu_key(gpu_train) == "train.use_gpu"


def test_a_gpu_stage_on_a_cluster_without_gpus_fails_fast_naming_the_key():
    from privcode.pipeline.placement import PlacementError, stage_resources

    cases = [
        ("eval", ["eval.use_gpu=true"], "eval.use_gpu"),
        ("pac", ["pac.use_gpu=true"], "pac.use_gpu"),
        ("audit", ["audit.use_gpu=true", "audit.cpus_per_model=0"], "audit.use_gpu"),
        ("nondp", ["train.use_gpu=true", "train.num_workers=1"], "train.use_gpu"),
    ]
    for name, overrides, key in cases:
        with pytest.raises(PlacementError, match=rf"{name} stage.*\({key} is true\).*no node"):
            stage_resources(STAGES[name], _demo(*overrides), [*MULTI, BIG_CPU])
    # More CPUs than any node has: named, not queued forever.
    with pytest.raises(PlacementError, match=r"4 CPUs \(train.cpus_per_worker\).*largest: 1"):
        stage_resources(STAGES["train"], _demo("train.cpus_per_worker=4"), MULTI)
    with pytest.raises(PlacementError, match=r"2 CPUs \(pac.num_cpus\)"):
        stage_resources(STAGES["pac"], _demo("pac.num_cpus=2"), MULTI)
    with pytest.raises(PlacementError, match="every CPU of one node, but no node"):
        stage_resources(STAGES["base"], _demo(), [HEAD])
    # An autoscaler group that may still start a GPU node makes the request placeable.
    group = {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}, "MaxCount": 2}
    assert stage_resources(STAGES["eval"], _demo("eval.use_gpu=true"), [*MULTI, group]) == {
        "num_cpus": 1.0,
        "num_gpus": 1.0,
    }


def test_ray_train_stages_get_gpus_through_the_scaling_config(tmp_path):
    """train/premium with use_gpu: the stage task holds no GPU; Ray Train's ScalingConfig gives
    each worker one, as the stage's Workers declare (and the GPU footprint counts)."""
    from privcode.models.ray_train import torch_trainer

    cfg = _demo(
        "train.num_workers=3",
        "train.use_gpu=true",
        "train.cpus_per_worker=2",
        "premium.num_workers=2",
        "premium.use_gpu=true",
    )
    for name, section in (("train", cfg.train), ("premium", cfg.premium)):
        stage = STAGES[name]
        assert stage.gpus(cfg) == 0.0 and stage.cpus(cfg) == 0
        (w,) = stage.workers(cfg)
        trainer = torch_trainer(
            lambda c: None,
            {},
            name="t",
            storage=tmp_path,
            num_workers=section.num_workers,
            cpus_per_worker=section.cpus_per_worker,
            use_gpu=section.use_gpu,
            max_failures=0,
        )
        scaling = trainer.scaling_config
        assert (w.count, w.required) == (scaling.num_workers, scaling.num_workers)
        assert (
            scaling.resources_per_worker
            == {"CPU": w.cpus, "GPU": w.gpus}
            == {
                "CPU": section.cpus_per_worker,
                "GPU": 1,
            }
        )
        assert stage.gpu_footprint(cfg) == section.num_workers
    assert STAGES["train"].workers(_demo()) == ()  # local mode: the task itself trains


def test_side_by_side_counts_gpus(monkeypatch):
    import ray

    gpu = _demo(
        "eval.use_gpu=true", "pac.use_gpu=true", "train.use_gpu=true", "train.num_workers=1"
    )
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    assert not runner._fits(STAGES["pac"], gpu, _running("eval"))  # the one GPU is taken
    assert not runner._fits(STAGES["train"], gpu, _running("eval"))  # its worker needs it
    assert runner._fits(STAGES["synth"], gpu, _running("eval"))  # CPU actors only
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    assert runner._fits(STAGES["pac"], gpu, _running("eval"))
    assert not runner._fits(STAGES["train"], gpu, _running("eval", "pac"))
    # More GPUs than the cluster has (16 world groups on 2): starts once no GPU is held.
    groups = _demo("eval.use_gpu=true", "pac.use_gpu=true", "pac.world_groups=16", "pac.worlds=16")
    assert runner._fits(STAGES["pac"], groups, _running("synth"))
    assert not runner._fits(STAGES["pac"], groups, _running("eval"))


#: Token auth for the simulated cluster's every node, as on a real head (set before the nodes
#: start: the driver turns it on when it connects, and a worker without it could not reach
#: the driver's objects, e.g. the audit's late premium input: OwnerDiedError).
CLUSTER_AUTH = """
import os
from privcode.cluster import ray_env
if not os.environ.get(ray_env.TOKEN_ENV):
    os.environ[ray_env.TOKEN_PATH_ENV] = os.path.join(sys.argv[1], "auth_token")
os.environ[ray_env.AUTH_MODE_ENV] = "token"
ray_env.ensure_token()
ray_env.prepare_driver_env(loopback=True)
"""

MULTI_NODE = (
    """
import json, sys
import ray
from ray.cluster_utils import Cluster
from privcode.config import load_config
from privcode.pipeline.runner import run_pipeline

root, cache, *overrides = sys.argv[1:]
"""
    + CLUSTER_AUTH
    + """
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
            "dashboard_host": "127.0.0.1"})
for _ in range(2):
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
try:
    cfg = load_config("jobs/configs/demo.yaml", [
        f"run.out_dir={root}/runs", f"run.reports_dir={root}/reports", "run.name=mn",
        f"run.ray_address={c.address}", f"base.cache_dir={cache}", *overrides,
    ])
    result = run_pipeline(cfg)
    print(json.dumps({n: r["status"] for n, r in result["stages"].items()}))
finally:
    ray.shutdown()
    c.shutdown()
"""
)


def _multi_node(script, *args, timeout=400):
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.heavy
def test_whole_node_stages_are_placed_on_a_multi_node_cluster(tmp_path, ci_base_cache):
    """A head with 0 CPUs and two 1-CPU workers (ray.cluster_utils.Cluster, 127.0.0.1): the
    base stage, which wants a whole node, runs. Asking for the cluster's 2 CPUs in one task
    (as before) was never placed: the run waited forever."""
    overrides = ["run.stages=[data, base]", "data.size=60", "data.canary_repetitions=[1]"]
    overrides += ["data.canary_kinds=[email]", "data.canary_placements=[joint]", "base.preset=ci"]
    assert _multi_node(MULTI_NODE, tmp_path, ci_base_cache, *overrides) == {
        "data": "ran",
        "base": "ran",
    }


#: Stage II and the premium model at CI size, on top of conftest's TINY_PIPELINE.
TINY_SYNTH_PREMIUM = [
    # Enough tokens for a CI junior's "def ..." to close (24 left every sample a syntax
    # error: nothing for the premium stage), and samples enough that some run.
    "synth.num_samples=32",
    "synth.shard_size=32",
    "synth.batch_size=16",
    "synth.max_new_tokens=64",
    "synth.min_runnable_fraction=0",
    "premium.min_records=1",
    "premium.max_length=64",
    "premium.batch_size=2",
    "audit.nondp_cpus=1",
]


@pytest.mark.slow
def test_the_demo_stages_all_run_on_a_multi_node_cluster(tmp_path, ci_base_cache):
    """`make demo`'s stage list (demo.yaml's run.stages) at CI size on the simulated cluster:
    a 0-CPU head and two 1-CPU workers. Every stage is placed and runs."""
    from conftest import TINY_PIPELINE, init_store

    stages = load_config("jobs/configs/demo.yaml").run.stages
    assert "nondp" in stages and "synth" in stages and "premium" in stages
    overrides = [o for o in TINY_PIPELINE if not o.startswith(("run.stages=", "run.name="))]
    overrides += [*TINY_SYNTH_PREMIUM, "eval.models=[base, junior, premium]"]
    overrides += [f"run.stages=[{', '.join(stages)}]"]
    overrides += [f"privacy.store={init_store(tmp_path / 'privacy-store')}"]
    assert _multi_node(MULTI_NODE, tmp_path, ci_base_cache, *overrides, timeout=900) == {
        s: "ran" for s in stages
    }


GPU_NODE_SCRIPT = (
    """
import json, sys, time
import ray
from ray.cluster_utils import Cluster
from privcode.config import load_config
from privcode.pipeline import runner
from privcode.pipeline.placement import PlacementError
from privcode.pipeline.plan import plan_pipeline
from privcode.pipeline.stages import STAGES

root = sys.argv[1]
"""
    + CLUSTER_AUTH
    + """
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1",
            "dashboard_host": "127.0.0.1"})
for _ in range(2):
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
out = {}
try:
    cfg = load_config("jobs/configs/demo.yaml", [
        f"run.out_dir={root}/runs", f"run.reports_dir={root}/reports", "run.name=gpu",
        f"run.ray_address={c.address}", "run.stages=[eval]", "eval.use_gpu=true",
    ])
    started = time.time()
    try:
        runner.run_pipeline(cfg)  # connects; no node has a GPU: refused before any stage starts
    except PlacementError as exc:
        out["refused"], out["refused_s"] = str(exc), time.time() - started
    out["plan_before"] = plan_pipeline(cfg).stage("eval").placeable
    gpu = c.add_node(num_cpus=1, num_gpus=1, node_ip_address="127.0.0.1")  # a fake GPU node
    c.wait_for_nodes()
    out["plan_after"] = plan_pipeline(cfg).stage("eval").placeable
    out["options"] = runner._ray_resources(STAGES["eval"], cfg)

    def where():  # what the eval stage's task would see: its GPU ids and node, never CUDA
        return ray.get_gpu_ids(), ray.get_runtime_context().get_node_id()

    ids, node = ray.get(ray.remote(where).options(**out["options"]).remote())
    out["gpu_ids"], out["on_gpu_node"] = ids, node == gpu.node_id
    # The seeds' paper.yaml planned on this live cluster (ray.nodes()), no model loaded.
    paper = load_config("jobs/configs/paper.yaml", [
        f"base.model={sys.argv[2]}", f"run.out_dir={root}/paper", f"run.reports_dir={root}/pr",
    ])
    plan = plan_pipeline(paper, records=int(sys.argv[3]))
    out["paper"] = {
        "cluster": plan.cluster,
        "placeable": plan.placeable,
        "stages": {s.stage: [s.placeable, s.problem] for s in plan.stages},
        "sigma": plan.privacy.noise_multiplier,
        "epsilon": plan.privacy.epsilon,
        "memory_bytes": plan.memory.total_bytes,
    }
    print(json.dumps(out))
finally:
    ray.shutdown()
    c.shutdown()
"""
)


@pytest.mark.heavy
def test_a_use_gpu_stage_is_placed_on_the_gpu_node(tmp_path):
    """The simulated cluster without a GPU refuses eval.use_gpu at once, naming the key; with
    a (fake) GPU node added, the eval stage's task options put it there, holding GPU 0; and
    the seeds' paper.yaml plans on that live cluster (placement, sigma, memory; no model)."""
    import json

    from test_plan import QWEN_1_5B, N

    model = tmp_path / "qwen-1.5b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_1_5B))
    out = _multi_node(GPU_NODE_SCRIPT, tmp_path, model, N)
    assert "eval.use_gpu is true" in out["refused"] and out["refused_s"] < 30
    assert out["plan_before"] is False and out["plan_after"] is True
    assert out["options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert out["gpu_ids"] == [0] and out["on_gpu_node"] is True
    # paper.yaml plans on the same live cluster: the seeds' sigma and the memory estimate; one
    # fake GPU node places the one-GPU stages, not 8 one-GPU Ray Train workers.
    paper = out["paper"]
    assert paper["cluster"] == "1 x {CPU 0}, 2 x {CPU 1}, 1 x {CPU 1, GPU 1}"
    assert abs(paper["sigma"] - 0.758) < 0.002 and 3.99 < paper["epsilon"] <= 4.0
    assert 20e9 < paper["memory_bytes"] < 60e9
    assert paper["placeable"] is False
    assert paper["stages"]["eval"] == [True, None] and paper["stages"]["data"][0] is True
    assert (
        paper["stages"]["train"][0] is False and "train.num_workers" in paper["stages"]["train"][1]
    )
