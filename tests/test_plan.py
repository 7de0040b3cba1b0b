"""`privcode plan` on jobs/configs/paper.yaml: placement on the chart's cluster shape plus GPU
nodes, the seeds' sigma calibration and the junior's memory estimate; no model runs (a
Qwen2.5-Coder-1.5B-shaped config.json stands in for the weights)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from privcode.cli import main
from privcode.config import load_config
from privcode.dp.accounting import DPEvent, epsilon
from privcode.pipeline.plan import parse_node, plan_pipeline

REPO = Path(__file__).parents[1]
PAPER = str(REPO / "jobs" / "configs" / "paper.yaml")
#: Magicoder-OSS-Instruct-75K: 75,197 rows; 90% members (67,677), 1,725 of them carrying a
#: canary in place (canaries add no rows).
N = 67_677
#: The published Qwen2.5-Coder-1.5B architecture (its config.json's shape fields).
QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}


def chart_nodes(gpu_nodes: int) -> list[dict]:
    """ray.nodes() of the chart's default RayCluster (head + the cpu group's replicas), plus
    ``gpu_nodes`` workers of the chart's gpu group shape (its CPU limit, gpusPerWorker)."""
    values = yaml.safe_load((REPO / "charts/privcode/values.yaml").read_text())
    head = float(values["head"]["resources"]["limits"]["cpu"])
    cpu, gpu = values["workerGroups"]["cpu"], values["workerGroups"]["gpu"]
    nodes = parse_node(f"CPU={head:g}")
    nodes += parse_node(f"CPU={cpu['resources']['limits']['cpu']},count={cpu['replicas']}")
    spec = f"CPU={gpu['resources']['limits']['cpu']},GPU={gpu['gpusPerWorker']}"
    return nodes + (parse_node(f"{spec},count={gpu_nodes}") if gpu_nodes else [])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-1.5b-shape")
    (path / "config.json").write_text(json.dumps(QWEN_1_5B))
    return path


@pytest.fixture(scope="module")
def paper(model_dir, tmp_path_factory):
    from conftest import init_store

    root = tmp_path_factory.mktemp("paper")
    store = init_store(root / "privacy-store")  # ingest keys its split with the store's key
    return load_config(
        PAPER,
        [
            f"base.model={model_dir}",
            f"run.out_dir={root}/runs",
            f"run.reports_dir={root}/r",
            f"privacy.store={store}",
        ],
    )


@pytest.fixture(scope="module")
def plan(paper):
    return plan_pipeline(paper, nodes=chart_nodes(gpu_nodes=8), records=N)


def test_paper_has_the_seeds_stages_and_settings(paper):
    assert {"eval", "audit", "pac", "premium"} <= set(paper.run.stages)
    assert paper.train.dtype == "bfloat16" and paper.train.micro_batch_size > 0
    assert paper.eval.use_gpu and paper.audit.use_gpu and paper.pac.use_gpu
    assert paper.premium.deepspeed == "zero3" and paper.train.steps == 400
    assert paper.data.inputs == ("/mnt/data/magicoder-oss-instruct-75k.jsonl",)


def test_paper_places_on_the_charts_cluster_with_gpu_nodes(plan):
    assert plan.placeable is True, plan.format()
    assert "1 x {CPU 2}, 1 x {CPU 4}, 8 x {CPU 8, GPU 1}" == plan.cluster
    train = plan.stage("train")
    assert (train.num_cpus, train.num_gpus) == (0, 0.0)  # the task only drives Ray Train
    assert [(w.count, w.cpus, w.gpus, w.required) for w in train.workers] == [(8, 4.0, 1.0, 8)]
    assert [(w.count, w.gpus) for w in plan.stage("premium").workers] == [(8, 1.0)]
    assert (plan.stage("eval").num_cpus, plan.stage("eval").num_gpus) == (1.0, 1.0)
    # The inline audit takes a whole GPU node: its 8 CPUs and its GPU.
    assert (plan.stage("audit").num_cpus, plan.stage("audit").num_gpus) == (8.0, 1.0)
    pac = plan.stage("pac")
    assert pac.num_gpus == 0.0  # 16 one-GPU group tasks, then a one-GPU evaluation task
    assert [(w.count, w.gpus) for w in pac.workers] == [(16, 1.0), (1, 1.0)]
    # Stage II: 2..8 one-GPU generators; the hf extractor (1..2) and the round trip (1..4) on
    # a GPU each; the sandboxes sized from the cluster (counted at their fewest here).
    synth = {w.kind: (w.count, w.cpus, w.gpus, w.required) for w in plan.stage("synth").workers}
    assert synth["Ray Data generator actors"] == (8, 1.0, 1.0, 2)
    assert synth["Ray Data extract filter actors"] == (2, 2.0, 1.0, 1)
    assert synth["Ray Data roundtrip filter actors"] == (4, 2.0, 1.0, 1)
    assert synth["Ray Data execution filter actors"][0] == 1
    assert plan.stage("base").num_cpus == 4.0  # a whole node: the largest without a GPU


def test_paper_does_not_place_without_enough_gpus(paper):
    none = plan_pipeline(paper, nodes=chart_nodes(gpu_nodes=0), records=N)
    assert none.placeable is False
    assert "eval.use_gpu is true" in none.stage("eval").problem
    assert "no node of this Ray cluster has one" in none.stage("audit").problem
    assert "train.num_workers" in none.stage("train").problem
    # The chart's gpu group at its maxReplicas (2): 8 one-GPU workers cannot start together.
    two = plan_pipeline(paper, nodes=chart_nodes(gpu_nodes=2), records=N)
    assert two.stage("eval").placeable and two.stage("pac").placeable  # groups queue
    assert not two.stage("train").placeable and not two.stage("premium").placeable
    assert not two.stage("synth").placeable  # 2 generators + 2 LLM filters: 4 GPUs at once
    assert "8 x (4 CPU, 1 GPU) (train.num_workers)" in two.stage("train").problem


def test_paper_calibrates_the_seeds_sigma_for_epsilon_4(plan, paper):
    """Table 4: q = 0.0131, sigma = 0.76, 400 steps, delta 1e-5, RDP -> epsilon 3.97."""
    p = plan.privacy
    assert (p.records, p.expected_batch_size, p.steps) == (N, 887, 400)
    assert p.sample_rate == pytest.approx(0.0131, abs=5e-5)
    assert p.calibrated and p.noise_multiplier == pytest.approx(0.758, abs=0.002)
    assert 3.99 < p.epsilon <= 4.0 and p.delta == 1e-5 and p.accountant == "rdp"
    # The seed's own sigma at this q spends the seed's epsilon.
    assert epsilon(DPEvent(0.76, p.sample_rate, 400), 1e-5) == pytest.approx(3.97, abs=0.01)


def test_the_junior_memory_estimate_fits_one_80gb_gpu(plan, paper, monkeypatch):
    m = plan.memory
    assert m.params == 1_543_714_304  # Qwen2.5-Coder-1.5B, tied head
    assert m.dtype == "bfloat16" and m.weights_bytes == 2 * m.params
    # LoRA r=16 on q,k,v,o,gate,up,down of 28 layers (18.5M) + E_c, E_p, D (dz 768, K 8).
    assert 30e6 < m.trainable_params < 50e6
    b, t = paper.train.micro_batch_size, paper.train.max_length + paper.train.num_virtual_tokens
    assert (m.micro_batch, m.sequence) == (b, t)
    assert m.logits_bytes == b * t * 151936 * 4 * 2  # junior + reference, fp32
    assert m.per_record_grads_bytes == m.trainable_params * 4 * b
    assert 20e9 < m.total_bytes < 0.75 * 80e9  # tens of GB, with room left on an 80 GB GPU
    # No cluster: no placement verdict. (A pytest worker may hold a Ray session from an earlier
    # test file; nodes=None would plan on it, so hide it.)
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "is_initialized", lambda: False)
    whole = plan_pipeline(paper, nodes=None, records=N, stages=["train"])
    assert whole.placeable is None and whole.memory == m  # no cluster: no placement verdict


def test_the_paper_data_path_is_named_when_absent(paper):
    from privcode.data.ingest.errors import IngestError
    from privcode.pipeline.runner import run_pipeline

    with pytest.raises(IngestError, match="/mnt/data/magicoder-oss-instruct-75k.jsonl: no such"):
        run_pipeline(paper, stages=["data"], use_ray=False)


def test_plan_cli(model_dir, tmp_path, capsys):
    args = ["plan", "--config", PAPER, "--set", f"base.model={model_dir}"]
    args += ["--set", f"run.out_dir={tmp_path}", "--records", str(N), "--stages", "train"]
    assert main([*args, "--node", "CPU=8,GPU=1,count=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placeable"] is True and out["privacy"]["expected_batch_size"] == 887
    assert out["memory"]["total_bytes"] > 20e9
    assert main([*args, "--node", "CPU=8,GPU=1,count=4"]) == 1  # 8 workers on 4 GPUs
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "ESTIMATE" in text and "sigma 0.758" in text
    assert main([*args, "--node", "CPU=x"]) == 2
    assert "--node 'CPU=x'" in capsys.readouterr().err
