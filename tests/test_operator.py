"""The privcode operator against a Kubernetes API mock (kmock) and a real privacy store
(issue 42): admission before any child exists, refusal with no child, the race for the last
budget, status mirrored from the RayJob and the ledger, a restart without a second
reservation, deletion that releases what was not spent and refunds nothing.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")
pytest.importorskip("fastapi")

from operator_support import NS, Kube, kube_api, ledger_service, operator  # noqa: E402

from privcode.privacy.ledger import Budget  # noqa: E402
from privcode.privacy.ledger_client import TOKEN_FILE_ENV, URL_ENV, RemoteLedger  # noqa: E402

RUN, JOB, CM = "privcode.dev/v1alpha1/privcoderuns", "ray.io/v1/rayjobs", "v1/configmaps"
TOKENS = {"operator": "o" * 32, "pipeline": "p" * 32}
TEMPLATE = {
    "apiVersion": "ray.io/v1",
    "kind": "RayJob",
    "metadata": {"name": "chart", "labels": {"app.kubernetes.io/part-of": "privcode"}},
    "spec": {
        "entrypoint": "python /app/jobs/pipeline.py --config /etc/privcode/pipeline.yaml",
        "rayClusterSpec": {
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {
                    "spec": {
                        "containers": [{"name": "ray-head", "image": "privcode:test"}],
                        "volumes": [{"name": "pipeline-config", "configMap": {"name": "chart"}}],
                    }
                },
            },
            "workerGroupSpecs": [
                {
                    "groupName": "cpu",
                    "rayStartParams": {},
                    "template": {
                        "spec": {
                            "containers": [{"name": "ray-worker", "image": "privcode:test"}],
                            "volumes": [
                                {"name": "pipeline-config", "configMap": {"name": "chart"}}
                            ],
                        }
                    },
                }
            ],
        },
    },
}


def _config() -> str:
    cfg = yaml.safe_load(Path("jobs/configs/demo.yaml").read_text())
    cfg["privacy"] = {"epsilon_budget": 5.0}
    return yaml.safe_dump(cfg)


def _data(root: Path, claim: str, n: int, tag: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "id": f"{tag}{i}",
            "prompt": f"{tag} task {i}",
            "code": f"def {tag}_{i}(x):\n    return x * {i}\n",
        }
        for i in range(n)
    ]
    (root / claim).mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), root / claim / "train.parquet")
    return "train.parquet"


def _run(name: str, claim: str, epsilon: float = 4.0) -> dict:
    return {
        "apiVersion": "privcode.dev/v1alpha1",
        "kind": "PrivCodeRun",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "config": {"inline": _config()},
            "data": {"claimName": claim, "path": "train.parquet"},
            "privacy": {"epsilon": epsilon},
        },
    }


def _phase(*phases: str):
    return lambda obj: (obj.get("status") or {}).get("phase") in phases


@pytest.fixture()
def cluster(tmp_path, monkeypatch):
    """(kube, store root, data root, ledger URL) with the operator running."""
    from privcode.privacy.budget import init_store

    store, _ = init_store(tmp_path / "store", Budget(5.0, 1e-5))
    data = tmp_path / "data"
    for claim, tag in (("corpus", "a"), ("other", "b")):
        _data(data, claim, 200, tag)
    token = tmp_path / "operator.token"
    token.write_text(TOKENS["operator"])
    with ledger_service(store.root, TOKENS) as ledger_url, kube_api() as url:
        monkeypatch.setenv(URL_ENV, ledger_url)
        monkeypatch.setenv(TOKEN_FILE_ENV, str(token))
        yield Kube(url), store.root, data, ledger_url


def test_a_run_is_admitted_before_its_rayjob_exists_and_a_second_is_refused(cluster):
    kube, store, data, ledger_url = cluster
    from privcode.operator.metrics import OperatorMetrics

    ledger = RemoteLedger(ledger_url, TOKENS["pipeline"])
    metrics = OperatorMetrics()
    with operator(kube.url, store, data, TEMPLATE, metrics=metrics):
        kube.create(RUN, _run("first", "corpus"))
        run = kube.wait(RUN, "first", _phase("Admitted"))
        assert run["status"]["epsilon"]["requested"] == 4.0
        assert 3.9 < run["status"]["epsilon"]["planned"] <= 4.0
        name = run["status"]["rayJob"]
        job = kube.get(JOB, name)
        owner = job["metadata"]["ownerReferences"][0]
        assert owner["kind"] == "PrivCodeRun" and owner["name"] == "first" and owner["controller"]
        assert "privacy.run_key=" in job["spec"]["entrypoint"]
        assert "train.epsilon=4.0" in job["spec"]["entrypoint"]
        head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        claims = {v["name"]: v for v in head["volumes"]}
        assert claims["run-data"]["persistentVolumeClaim"] == {
            "claimName": "corpus",
            "readOnly": True,
        }
        assert claims["pipeline-config"]["configMap"]["name"] == f"{name}-config"
        assert kube.get(CM, f"{name}-config")["data"]["pipeline.yaml"] == _config()
        shown = ledger.call("show")
        assert [j["status"] for j in shown["jobs"]] == ["running"]  # reserved before the pods

        kube.create(RUN, _run("second", "corpus"))
        refused = kube.wait(RUN, "second", _phase("Refused"))
        (cond,) = refused["status"]["conditions"]
        assert cond["type"] == "Refused" and "epsilon" in cond["message"]
        assert len(kube.list(JOB)) == 1  # nothing was created for the refused run
        (event,) = kube.wait_list("v1/events", lambda e: e.get("reason") == "Refused")
        assert event["type"] == "Warning" and "epsilon" in event["message"]
        assert event["involvedObject"]["name"] == "second"
    text = metrics.text()
    for line in (
        'privcode_operator_admissions_total{result="admitted"} 1.0',
        'privcode_operator_admissions_total{result="refused"} 1.0',
        'privcode_operator_runs{phase="Admitted"} 1.0',
        'privcode_operator_runs{phase="Refused"} 1.0',
    ):
        assert line in text, text
    assert len(ledger.call("show")["jobs"]) == 1


def test_two_runs_racing_for_the_last_budget_one_is_admitted(cluster):
    kube, store, data, _ = cluster
    with operator(kube.url, store, data, TEMPLATE):
        threads = [
            threading.Thread(target=kube.create, args=(RUN, _run(n, "other")))
            for n in ("left", "right")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ended = [kube.wait(RUN, n, _phase("Admitted", "Refused")) for n in ("left", "right")]
        assert sorted(r["status"]["phase"] for r in ended) == ["Admitted", "Refused"]
        assert len(kube.list(JOB)) == 1


def test_status_mirrors_the_job_and_a_restart_reserves_nothing_twice(cluster):
    kube, store, data, ledger_url = cluster
    pipeline = RemoteLedger(ledger_url, TOKENS["pipeline"])
    with operator(kube.url, store, data, TEMPLATE):
        kube.create(RUN, _run("mirrored", "corpus"))
        name = kube.wait(RUN, "mirrored", _phase("Admitted"))["status"]["rayJob"]
    (reserved,) = pipeline.call("show")["jobs"]
    # The child's train stage takes the reservation over (its own admit, same run key) and
    # is granted steps; the operator meanwhile restarted.
    key = _run_key(store, kube, "mirrored")
    plan = reserved["plan"]
    fps = _fingerprints(store, data / "corpus" / "train.parquet")
    taken = pipeline.call("admit", fps, plan, Budget(5.0, 1e-5).to_dict(), run="t", run_key=key)
    assert taken["admitted"]
    for i in range(3):
        pipeline.call(
            "reserve",
            taken["job"],
            plan["noise_multiplier"],
            plan["sample_rate"],
            1,
            request_id=f"x:{i}",
        )
    kube.patch_status(JOB, name, {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"})
    artifacts = data.parent / "artifacts"
    _train_manifest(artifacts / "runs" / "mirrored" / "train")
    with operator(kube.url, store, data, TEMPLATE, artifacts):
        run = kube.wait(RUN, "mirrored", lambda o: o["status"].get("steps") == 3)
        assert run["status"]["phase"] == "Running" and run["status"]["epsilon"]["spent"] > 0
        assert run["status"]["stages"] == {"train": "Succeeded"}
        assert len(run["status"]["releaseDigest"]) == 64 and "report" not in run["status"]
        assert len(pipeline.call("show")["jobs"]) == 2  # resumed: no new reservation
        kube.patch_status(JOB, name, {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"})
        done = kube.wait(RUN, "mirrored", _phase("Succeeded"))
    assert done["status"]["steps"] == 3
    assert all(j["status"] == "finished" for j in pipeline.call("show")["jobs"])


def test_deleting_a_run_releases_its_unused_reservation_and_refunds_nothing(cluster):
    kube, store, data, ledger_url = cluster
    pipeline = RemoteLedger(ledger_url, TOKENS["pipeline"])
    with operator(kube.url, store, data, TEMPLATE):
        kube.create(RUN, _run("gone", "corpus"))
        kube.wait(RUN, "gone", _phase("Admitted"))
        (job,) = pipeline.call("show")["jobs"]
        digest = hashlib.sha256((data / "corpus" / "train.parquet").read_bytes()).hexdigest()
        plan = job["plan"]
        step = pipeline.call(
            "reserve",
            job["job"],
            plan["noise_multiplier"],
            plan["sample_rate"],
            1,
            request_id="y:0",
            dataset=digest,
        )
        assert step["granted"] == 1
        kube.delete(RUN, "gone")
        kube.wait_gone(RUN, "gone")
    (after,) = pipeline.call("show")["jobs"]
    assert after["status"] == "finished" and after["steps_granted"] == 1  # kept: no refund
    spent = pipeline.call("show")["epsilon_spent"]
    assert 0 < spent < 3.0  # one step (RDP: 1.94), not the whole plan (4.0)


def _train_manifest(stage: Path) -> None:
    from privcode.artifacts.manifest import StageManifest

    outputs = {"release/adapter.safetensors": "ab" * 32, "release/privacy.json": "cd" * 32}
    StageManifest("train", "fp", {}, outputs=outputs).write(stage / "manifest.json")


def _run_key(store: Path, kube: Kube, name: str) -> str:
    from privcode.operator.admission import run_key_of

    run = kube.get(RUN, name)
    return run_key_of(str(store), NS, name, run["metadata"]["uid"])


def _fingerprints(store: Path, path: Path) -> bytes:
    from privcode.data.records import read_records
    from privcode.privacy.ledger import pack_fingerprints
    from privcode.privacy.store import PrivacyStore

    pairs = [(r.prompt, r.code) for r in read_records(path)]
    return pack_fingerprints(PrivacyStore(store).record_fingerprints(pairs))


def test_submit_job_goes_through_a_privcoderun_when_the_operator_is_installed(cluster):
    """`make submit-job TARGET=k8s`'s path with the operator: a PrivCodeRun is created and
    followed to its end; the RayJob exists only once the run is admitted."""
    from kubernetes import client

    from privcode.cluster import k8s_run

    kube, store, data, _ = cluster
    conf = client.Configuration()
    conf.host = kube.url
    api = client.ApiClient(conf)
    assert k8s_run.operator_installed(api)
    config = data.parent / "pipeline.yaml"
    config.write_text(_config())
    with pytest.raises(Exception, match="set by the PrivCodeRun"):
        k8s_run.run_manifest(
            config,
            ["privacy.store=/x"],
            name="x",
            data_claim="corpus",
            data_path="train.parquet",
            epsilon=4.0,
            stages=[],
        )
    from privcode.cluster.k8s import ManifestError, submit_pipeline_k8s

    submit = {"namespace": NS, "api_client": api, "stages": ["data", "train"]}
    with pytest.raises(ManifestError, match="DATA_CLAIM"):
        submit_pipeline_k8s(config, ["run.name=submitted"], **submit)
    with operator(kube.url, store, data, TEMPLATE):
        submitted = submit_pipeline_k8s(
            config,
            ["run.name=submitted", "train.steps=30"],
            data_claim="corpus",
            data_path="train.parquet",
            follow=False,
            **submit,
        )
        assert submitted == {"name": "submitted", "status": "SUBMITTED"}
        name = kube.wait(RUN, "submitted", _phase("Admitted"))["status"]["rayJob"]
        job = kube.get(JOB, name)
        assert "--set run.stages=[data, train]" in job["spec"]["entrypoint"].replace("'", "")
        kube.patch_status(JOB, name, {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"})
        out = k8s_run.follow_run(api, "submitted", NS, timeout_s=60, poll_s=0.2)
    assert out["status"] == "SUCCEEDED" and out["epsilon"]["requested"] == 4.0


def test_a_budget_raise_object_applies_the_authoritys_grant_once(cluster):
    """A PrivacyBudgetRaise carries the data owner's signed grant: applied once, logged with
    who and why; a forged or replayed grant is Refused; a PrivacyBudget mirrors the store."""
    from privcode.privacy.raising import raise_with_authority

    kube, store, data, ledger_url = cluster
    raises = "privcode.dev/v1alpha1/privacybudgetraises"
    grant = raise_with_authority(store, None, to=6.0, who="owner", why="study 2", deliver=False)
    forged = {**grant, "message": {**grant["message"], "to": 60.0}}

    def raise_object(name: str, body: dict) -> dict:
        meta = {"name": name, "namespace": NS}
        return {
            "apiVersion": "privcode.dev/v1alpha1",
            "kind": "PrivacyBudgetRaise",
            "metadata": meta,
            "spec": {"grant": body},
        }

    with operator(kube.url, store, data, TEMPLATE):
        kube.create(raises, raise_object("forged", forged))
        refused = kube.wait(raises, "forged", _phase("Refused"))
        assert "signature" in refused["status"]["message"]
        kube.create(raises, raise_object("study-2", grant))
        applied = kube.wait(raises, "study-2", _phase("Applied"))
        assert "owner" in applied["status"]["message"]
        kube.create(raises, raise_object("again", grant))  # a grant raises once
        assert "already used" in kube.wait(raises, "again", _phase("Refused"))["status"]["message"]
        kube.create(
            "privcode.dev/v1alpha1/privacybudgets",
            {
                "apiVersion": "privcode.dev/v1alpha1",
                "kind": "PrivacyBudget",
                "metadata": {"name": "store", "namespace": NS},
                "spec": {},
            },
        )
        budget = kube.wait(
            "privcode.dev/v1alpha1/privacybudgets",
            "store",
            lambda o: (o.get("status") or {}).get("budget") == 6.0,
        )
        assert budget["status"]["left"] == 6.0 and budget["status"]["jobs"] == 0
    shown = RemoteLedger(ledger_url, TOKENS["pipeline"]).call("show")
    assert shown["budget"]["epsilon"] == 6.0
