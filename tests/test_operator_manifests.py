"""The operator's manifests (issue 42): its CRDs are valid CustomResourceDefinitions whose
printer columns name fields of their own schema, and the RayJob it makes from the chart's
rendering still passes KubeRay's CRD schema with the run's data claim, config and owner."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from chart_support import CI_VALUES, by_kind, crd_problems, k8s_problems, one, render

CRDS = sorted((Path(__file__).parents[1] / "charts" / "privcode" / "crds").glob("*.yaml"))


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.name)
def test_the_crds_are_valid_and_their_columns_exist(path):
    crd = yaml.safe_load(path.read_text())
    assert not k8s_problems(crd), k8s_problems(crd)
    (version,) = crd["spec"]["versions"]
    assert version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        node = schema
        for part in column["jsonPath"].strip(".").split("."):
            if part in ("metadata",):
                break
            node = node["properties"][part]
        else:
            assert node["type"] in ("string", "number", "integer"), column


@pytest.mark.chart
def test_the_operators_rayjob_from_the_charts_rendering_passes_kuberay(helm, crds):
    from privcode.operator.children import child_name, config_map_for, rayjob_for

    template = one(render(helm, "-f", str(CI_VALUES)), "RayJob")
    run = {
        "metadata": {"name": "study-1", "namespace": "team", "uid": "0123456789abcdef"},
    }
    name = child_name("study-1", run["metadata"]["uid"])
    job = rayjob_for(
        template,
        run,
        name=name,
        config_map=f"{name}-config",
        data_claim="corpus",
        data_mount="/mnt/data/corpus",
        overrides=["run.name=study-1", "privacy.run_key=k-abc"],
    )
    assert not crd_problems(job), crd_problems(job)
    assert not k8s_problems(config_map_for(run, f"{name}-config", "run: {}\n"))
    assert job["metadata"]["ownerReferences"][0]["uid"] == "0123456789abcdef"
    assert job["spec"]["entrypoint"].endswith("--set run.name=study-1 --set privacy.run_key=k-abc")
    for spec in [job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    ]:
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["run-data"]["persistentVolumeClaim"]["readOnly"] is True
        assert volumes["pipeline-config"]["configMap"]["name"] == f"{name}-config"
    assert not by_kind([job], "Deployment")  # executors are not the run's: no data there


def test_the_preflight_of_an_operator_run_does_not_count_its_reservation_twice(tmp_path):
    """The ledger's question with the run's key is the one its train stage's admit answers:
    the run's own unfinished reservation counts its grants only."""
    from conftest import init_store

    from privcode.dp.accounting import DPEvent
    from privcode.privacy.ledger import Budget, StoreLedger, pack_fingerprints
    from privcode.privacy.store import PrivacyStore

    root = init_store(tmp_path / "store")
    rows = [(f"p{i}", f"x = {i}\n") for i in range(50)]
    fps = pack_fingerprints(PrivacyStore(root).record_fingerprints(rows))
    plan, budget = DPEvent(1.0, 0.05, 60).to_dict(), Budget(4.0, 1e-5).to_dict()
    ledger = StoreLedger(root)
    try:
        fresh = ledger.admission(fps, plan, budget)["epsilon_after"]
        assert ledger.admit(fps, plan, budget, run="op", run_key="k")["admitted"]
        again = ledger.admission(fps, plan, budget)
        mine = ledger.admission(fps, plan, budget, run_key="k")
        assert again["epsilon_after"] > fresh and not again["admitted"]
        assert mine["admitted"] and mine["epsilon_after"] == pytest.approx(fresh)
        assert ledger.admit(fps, plan, budget, run="stage", run_key="k")["admitted"]
        assert ledger.run_spent("k")["jobs"] == 2 and ledger.run_spent("k")["running"]
    finally:
        ledger.close()


def test_a_queued_run_is_created_suspended_for_kueue():
    """spec.queueName composes with Kueue: the admitted run's RayJob carries the queue label
    and starts suspended (Kueue unsuspends it on quota); without it, it starts at once."""
    from privcode.operator.children import KUEUE_LABEL, rayjob_for
    from privcode.operator.spec import SpecError, parse_run

    base = {
        "config": {"inline": "run: {name: x}\n"},
        "data": {"claimName": "corpus", "path": "train.parquet"},
        "privacy": {"epsilon": 2.0},
    }
    assert parse_run({**base, "queueName": "team-gpus"}, {}).queue_name == "team-gpus"
    with pytest.raises(SpecError, match="queueName"):
        parse_run({**base, "queueName": "Not A Queue"}, {})
    with pytest.raises(SpecError, match="claimName"):
        parse_run({**base, "data": {"claimName": "../privacy-store", "path": "x"}}, {})
    template = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "t"},
        "spec": {
            "entrypoint": "python x.py",
            "rayClusterSpec": {"headGroupSpec": {"template": {"spec": {"containers": [{}]}}}},
        },
    }
    run = {"metadata": {"name": "r", "namespace": "ns", "uid": "u1"}}
    kw = {"name": "r-u1", "config_map": "c", "data_claim": "corpus", "data_mount": "/mnt/data/c"}
    queued = rayjob_for(template, run, overrides=[], queue_name="team-gpus", **kw)
    assert queued["spec"]["suspend"] is True
    assert queued["metadata"]["labels"][KUEUE_LABEL] == "team-gpus"
    now = rayjob_for(template, run, overrides=[], **kw)
    assert "suspend" not in now["spec"] and KUEUE_LABEL not in now["metadata"]["labels"]
