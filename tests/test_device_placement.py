"""Where eval, audit, pac and Stage II run their models, and in which dtype (issue 19).

CPU only, fast: the device/dtype choice (:mod:`privcode.models.placement`),
bf16 weights on the CPU that really load and generate, ``use_gpu`` without a
visible CUDA device failing with the config key named (never a CPU run), and
the Ray options of the audit's per-model tasks, the PAC group and evaluation
tasks and the LLM-filter actors (the option-building functions; no GPU task
is started). tests/test_gpu.py runs the same paths on a CUDA device.
"""

from __future__ import annotations

import json

import pytest
import torch

from privcode.config import PacConfig, SynthConfig, load_config
from privcode.models.placement import DevicePlacementError, Placement, placement, task_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def no_cuda(monkeypatch):
    """This process sees no CUDA device (whatever the machine has)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --------------------------------------------------------------------------- the choice


def test_cpu_placement_resolves_the_config_dtype():
    assert placement(False, "auto", "eval.use_gpu") == Placement(torch.device("cpu"), torch.float32)
    assert placement(False, "float32", "eval.use_gpu").dtype == torch.float32
    assert placement(False, "bfloat16", "eval.use_gpu").dtype == torch.bfloat16
    cpu = placement(False, "bfloat16", "k")
    assert not cpu.cuda and cpu.describe() == {"device": "cpu", "dtype": "bfloat16"}
    with cpu.autocast():  # no autocast on the CPU: weights carry the dtype themselves
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="unknown dtype 'float16'"):
        placement(False, "float16", "k")


@pytest.mark.parametrize("key", ["eval.use_gpu", "audit.use_gpu", "pac.use_gpu"])
def test_use_gpu_without_cuda_names_the_key(no_cuda, key):
    with pytest.raises(DevicePlacementError, match=rf"{key} asks for a GPU.*set {key}=false"):
        task_device(True, key)
    assert task_device(False, key) == torch.device("cpu")


def test_synth_dtype_and_filter_resources_are_config_fields():
    cfg = load_config(
        None, overrides=["synth.dtype=bfloat16", "synth.filter_gpus=1", "synth.filter_cpus=4"]
    )
    assert (cfg.synth.dtype, cfg.synth.filter_gpus, cfg.synth.filter_cpus) == ("bfloat16", 1, 4)
    assert SynthConfig().dtype == "auto" and SynthConfig().filter_gpus == 0.0
    from privcode.config import ConfigError

    with pytest.raises(ConfigError, match="synth.dtype"):
        load_config(None, overrides=["synth.dtype=float16"])
    with pytest.raises(ConfigError, match="synth.filter_gpus"):
        load_config(None, overrides=["synth.filter_gpus=-1"])


# --------------------------------------------------------------------------- Ray options


def test_audit_model_tasks_ask_for_a_gpu_with_use_gpu():
    from privcode.audit.run import model_task_options

    cpu = load_config(None, overrides=["audit.cpus_per_model=2"])
    assert model_task_options(cpu, "junior", "audits") == {
        "name": "privcode:audit:junior:audits",
        "num_cpus": 2.0,
    }
    gpu = load_config(None, overrides=["audit.cpus_per_model=2", "audit.use_gpu=true"])
    for part in ("audits", "probe"):
        opts = model_task_options(gpu, "premium", part)
        assert opts["num_gpus"] == 1.0 and opts["num_cpus"] == 2.0
    assert "num_gpus" not in model_task_options(gpu, "<fidelity>", "fidelity")  # no LLM there


def test_pac_group_and_evaluation_tasks_ask_for_a_gpu_with_use_gpu():
    from privcode.pac.evaluate import _own_gpu_task, eval_task_options
    from privcode.pac.worlds import group_task_options

    assert group_task_options(PacConfig()) == {"num_cpus": 1}
    assert group_task_options(PacConfig(use_gpu=True)) == {"num_cpus": 1, "num_gpus": 1.0}
    assert eval_task_options(PacConfig(use_gpu=True))["num_gpus"] == 1.0
    # One group: the stage's task holds the GPU and evaluates itself; no Ray task, ever.
    assert not _own_gpu_task(PacConfig(use_gpu=True, world_groups=1))
    assert not _own_gpu_task(PacConfig(use_gpu=False, world_groups=4))


def test_filter_actors_resources():
    from privcode.synth.pipeline import (
        EXECUTION_CPUS,
        EXTRACT_CPUS,
        FILTER_CPUS,
        ROUNDTRIP_CPUS,
        filter_actor_options,
        filter_footprint,
    )

    default = SynthConfig()
    assert filter_actor_options(default) == {  # as before: small CPU shares, no GPU
        "extract": {"num_cpus": EXTRACT_CPUS},
        "execution": {"num_cpus": EXECUTION_CPUS},
        "roundtrip": {"num_cpus": ROUNDTRIP_CPUS},
    }
    assert filter_footprint(default) == (pytest.approx(FILTER_CPUS), 0.0)
    # filter_* without an LLM filter changes nothing.
    assert filter_actor_options(SynthConfig(filter_gpus=1, filter_cpus=4)) == (
        filter_actor_options(default)
    )
    hf = SynthConfig(extractor="hf", summarizer="hf", filter_gpus=1, filter_cpus=4)
    opts = filter_actor_options(hf)
    assert opts["extract"] == {"num_cpus": 4, "num_gpus": 1.0}
    assert opts["roundtrip"] == {"num_cpus": 4, "num_gpus": 1.0}
    assert opts["execution"] == {"num_cpus": EXECUTION_CPUS}  # the sandbox needs no GPU
    assert filter_footprint(hf) == (pytest.approx(8 + EXECUTION_CPUS), 2.0)
    bert = filter_actor_options(SynthConfig(scorer="bertscore", filter_gpus=0.5))
    assert bert["roundtrip"] == {"num_cpus": ROUNDTRIP_CPUS, "num_gpus": 0.5}
    assert bert["extract"] == {"num_cpus": EXTRACT_CPUS}  # the offline extractor


def test_every_filter_is_its_own_pool():
    from privcode.config import load_config
    from privcode.errors import ConfigError
    from privcode.pipeline.stages import SynthStage
    from privcode.synth.resources import (
        filter_actor_options,
        filter_batch_sizes,
        filter_footprint,
        filter_pools,
    )

    default = SynthConfig()
    # Most 0 (the default): before the run, the fewest; at the run, one actor per CPU of the
    # cluster (whole CPUs), and per GPU for an actor that holds GPUs.
    assert filter_pools(default) == {"extract": (1, 1), "execution": (1, 1), "roundtrip": (1, 1)}
    assert filter_pools(default, {"CPU": 8.0}) == {
        "extract": (1, 8),
        "execution": (1, 8),
        "roundtrip": (1, 8),
    }
    assert filter_pools(SynthConfig(scorers_min=3), {"CPU": 2.0})["roundtrip"] == (3, 3)
    gpu = SynthConfig(extractor="hf", filter_gpus=1, filter_cpus=4)
    assert filter_pools(gpu, {"CPU": 64.0, "GPU": 3.0}) == {
        "extract": (1, 3),  # its GPUs bound it
        "execution": (1, 64),
        "roundtrip": (1, 64),
    }
    assert filter_pools(gpu, {"CPU": 6.0, "GPU": 3.0})["extract"] == (1, 1)  # 4 CPUs each
    assert SynthStage.footprint(load_config(None)) is None  # sized from the cluster: alone
    # The round trip's calls: up to 512 samples, a shard at most (its length-sorted batches).
    assert filter_batch_sizes(default) == {"extract": 16, "execution": 16, "roundtrip": 250}
    assert filter_batch_sizes(SynthConfig(shard_size=1000))["roundtrip"] == 512
    assert filter_batch_sizes(SynthConfig(shard_size=8))["roundtrip"] == 16
    cfg = SynthConfig(
        batch_size=32,
        executors_min=2,
        executors_max=4,
        execution_cpus=0.5,
        execution_batch_size=64,
        scorers_max=3,
        roundtrip_cpus=1.0,
        extractor="hf",
        filter_cpus=2.0,
        filter_gpus=1.0,
        extract_cpus=3.0,  # its own CPUs win over filter_cpus
    )
    assert filter_pools(cfg) == {"extract": (1, 1), "execution": (2, 4), "roundtrip": (1, 3)}
    assert filter_batch_sizes(cfg) == {"extract": 32, "execution": 64, "roundtrip": 250}
    assert filter_actor_options(cfg) == {
        "extract": {"num_cpus": 3.0, "num_gpus": 1.0},
        "execution": {"num_cpus": 0.5},
        "roundtrip": {"num_cpus": 1.0},  # the offline summariser and MiniLM: no GPU
    }
    assert filter_footprint(cfg) == (pytest.approx(3.0 + 4 * 0.5 + 3 * 1.0), 1.0)
    # The planner sees each pool: most actors, and the fewest that must fit.
    cfg_all = load_config(
        None,
        overrides=[
            "synth.executors_min=2",
            "synth.executors_max=4",
            "synth.scorers_max=3",
            "synth.extractors_max=1",
        ],
    )
    workers = {w.kind: w for w in SynthStage.workers(cfg_all)}
    execution = workers["Ray Data execution filter actors"]
    assert (execution.count, execution.required, execution.key) == (4, 2, "synth.executors_max")
    assert workers["Ray Data roundtrip filter actors"].count == 3
    assert SynthStage.footprint(cfg_all) == pytest.approx(
        cfg_all.synth.generators_max * cfg_all.synth.cpus_per_generator + 0.1 + 4 * 0.2 + 3 * 0.2
    )
    with pytest.raises(ConfigError, match="synth.scorers_max: is below synth.scorers_min"):
        load_config(None, overrides=["synth.scorers_min=3", "synth.scorers_max=2"])


# --------------------------------------------------------------------------- no silent CPU


def test_stage2_actors_refuse_a_gpu_they_cannot_see(no_cuda, ci_release):
    from privcode.synth.operators import Extract, Generate, RoundTripScore

    with pytest.raises(DevicePlacementError, match="synth.gpus_per_generator"):
        Generate(str(ci_release), {"gpu": True, "dtype": "auto"}, [])
    llm = {"gpu": True, "dtype": "auto", "key": "synth.filter_gpus"}
    with pytest.raises(DevicePlacementError, match="synth.filter_gpus"):
        Extract("hf", {"model": "/nowhere"}, llm)
    with pytest.raises(DevicePlacementError, match="synth.filter_gpus"):
        RoundTripScore("hf", "embedding", -1.0, {"summarizer_model": "/nowhere"}, llm)
    assert Extract("offline", {}, llm).extractor.name == "offline"  # no model: no device


def test_audit_with_use_gpu_and_no_cuda_fails_before_any_model(no_cuda, ci_release, tmp_path):
    from privcode.audit.run import run_audits

    cfg = load_config(None, overrides=["audit.use_gpu=true", "audit.audits=[mia]"])
    run = {"release": ci_release, "base": ci_release, "train": tmp_path, "heldout": tmp_path}
    with pytest.raises(DevicePlacementError, match="audit.use_gpu"):
        run_audits(cfg, tmp_path, run, {"junior": ci_release})


def test_nondp_comparison_with_use_gpu_and_no_cuda_names_the_key(no_cuda, tmp_path):
    from privcode.train.nondp import train_nondp_comparison

    cfg = load_config(None, overrides=["train.use_gpu=true", "audit.compare_nondp=true"])
    with pytest.warns(RuntimeWarning, match="WITHOUT differential privacy"):
        with pytest.raises(DevicePlacementError, match="train.use_gpu"):
            train_nondp_comparison(cfg, data=tmp_path, base="ci", out_dir=tmp_path / "out")


def test_pac_eval_and_worlds_with_use_gpu_and_no_cuda_name_the_key(no_cuda, tmp_path):
    from privcode.pac.evaluate import evaluate_pac
    from privcode.pac.worlds import _train_group

    cfg = PacConfig(worlds=2, use_gpu=True)
    with pytest.raises(DevicePlacementError, match="pac.use_gpu"):
        evaluate_pac(cfg, str(tmp_path), heldout=str(tmp_path / "h.parquet"))
    with pytest.raises(DevicePlacementError, match="pac.use_gpu"):
        _train_group(cfg, str(tmp_path), [], 0, None, [0, 1], str(tmp_path), False)


# --------------------------------------------------------------------------- bf16 on the CPU


def test_release_loads_bf16_weights_and_generates(ci_release):
    from privcode.models.junior import load_release
    from privcode.synth.operators import Generate

    full = load_release(ci_release)
    half = load_release(ci_release, dtype="bfloat16")
    assert {p.dtype for p in full.model.parameters()} == {torch.float32}
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    assert half.prefix_decoder.weight.dtype == torch.float32  # D stays fp32; D(z) is cast
    # The adapter is merged in fp32, then cast: one rounding of the fp32 junior.
    for (name, a), (_, b) in zip(
        full.model.state_dict().items(), half.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a.to(torch.bfloat16), b), name
    texts = half.generate(n=3, max_new_tokens=6, temperature=0.8, seed=1)
    assert len(texts) == 3 and all(isinstance(t, str) for t in texts)
    assert half.generate(n=3, max_new_tokens=6, temperature=0.8, seed=1) == texts  # seeded
    # The Stage II generator actor in synth.dtype, on the CPU it reserved.
    gen = Generate(str(ci_release), {"gpu": False, "dtype": "bfloat16", **_GEN}, [])
    assert gen.placement == {"device": "cpu", "dtype": "bfloat16"}
    assert {p.dtype for p in gen.release.model.parameters()} == {torch.bfloat16}
    import numpy as np

    out = gen({"index": np.arange(2), "z_seed": np.array(["0:0", "0:1"], dtype=object)})
    assert len(out["code"]) == 2


_GEN = {"seed": 0, "max_new_tokens": 6, "temperature": 0.8, "top_p": 0.95, "trim": False}


def test_eval_generator_in_bf16(ci_model):
    from privcode.eval.benchmarks import Problem
    from privcode.eval.completions import generate_completions, load_generator

    gen = load_generator(ci_model, device="cpu", dtype=torch.bfloat16)
    assert gen.info["dtype"] == "bfloat16" and gen.info["device"] == "cpu"
    assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    problem = Problem("t/0", "def add(a, b):\n", "assert add(1, 2) == 3\n", "add", "humaneval")
    samples = generate_completions(gen, [problem], max_new_tokens=8, progress=False)
    assert [s.task_id for s in samples] == ["t/0"] and isinstance(samples[0].completion, str)
    assert load_generator(ci_model).info["dtype"] == "float32"  # the CPU default is unchanged


def test_audit_scoring_in_bf16_is_close_to_fp32(ci_release, tmp_path):
    """Per-record NLLs from bf16 weights (float32 logits) within 5% of the fp32 ones."""
    from privcode.audit.scoring import load_scored_model, record_losses
    from privcode.data.records import read_records, write_records

    path = tmp_path / "r.jsonl"
    write_records(
        [
            {"id": f"r{i}", "prompt": f"Add {i}.", "code": ADD.replace("b", f"b + {i}")}
            for i in range(4)
        ],
        path,
    )
    records = read_records(path)
    full = load_scored_model(ci_release)
    half = load_scored_model(ci_release, dtype=torch.bfloat16)
    assert half.model.get_input_embeddings().weight.dtype == torch.bfloat16
    a, b = record_losses(full, None, records), record_losses(half, None, records)
    assert b.dtype == a.dtype and torch.isfinite(torch.from_numpy(b)).all()
    torch.testing.assert_close(torch.from_numpy(b), torch.from_numpy(a), rtol=0.05, atol=0.0)


def test_hf_filters_in_bf16_on_their_actor(ci_model):
    from privcode.synth.operators import Extract, RoundTripScore

    llm = {"gpu": False, "dtype": "bfloat16", "key": "synth.filter_gpus"}
    ex = Extract("hf", {"model": ci_model, "max_new_tokens": 6}, llm)
    import numpy as np

    batch = {"code": np.array([ADD], dtype=object), "cond_prompt": np.array([""], dtype=object)}
    out = ex(batch)
    assert len(out["prompt"]) == 1 and isinstance(out["prompt"][0], str)
    assert ex.extractor.generator._model.dtype == torch.bfloat16
    models = {"summarizer_model": ci_model, "scorer_model": ci_model}
    rt = RoundTripScore("hf", "bertscore", 0.5, models, llm)
    scorer, summarizer = rt.filter.scorer, rt.filter.summarizer
    assert (scorer.device, scorer.dtype) == ("cpu", torch.bfloat16)
    assert (summarizer.generator.device, summarizer.generator.dtype) == ("cpu", torch.bfloat16)
    scores = rt.filter.score(["Add two numbers."], [ADD])
    assert len(scores) == 1 and -1.0 <= scores[0] <= 1.0
    assert scorer._model.dtype == torch.bfloat16


def test_pac_worlds_train_fp32_adapters_over_a_bf16_base(ci_model, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from privcode.data.records import write_records
    from privcode.pac.evaluate import evaluate_pac
    from privcode.pac.worlds import train_worlds

    data = tmp_path / "train.jsonl"
    write_records(
        [
            {
                "id": f"r{i}",
                "prompt": f"Return {i} plus x.",
                "code": f"def f{i}(x):\n    return x + {i}\n",
            }
            for i in range(8)
        ],
        data,
    )
    cfg = PacConfig(
        worlds=2,
        steps=3,
        batch_size=2,
        lr=1e-2,
        max_length=24,
        lora_r=2,
        dtype="bfloat16",
        eval_sessions=1,
        eval_tokens=2,
        eval_positions=4,
        eval_canaries=0,
    )
    with pytest.warns(RuntimeWarning, match="WITHOUT DP"):
        summary = train_worlds(
            cfg, data=data, base=ci_model, out_dir=tmp_path / "w", progress=False
        )
    assert summary["groups"][0]["device"] == "cpu"
    for world in ("w000", "w001"):
        weights = load_file(str(tmp_path / "w" / "adapters" / world / "adapter_model.safetensors"))
        assert {t.dtype for t in weights.values()} == {torch.float32}
        trained = [t for k, t in weights.items() if "lora_B" in k]  # B starts at zero
        assert trained and all(torch.isfinite(t).all() for t in trained)
        assert any(t.abs().sum() > 0 for t in trained)

    import privcode.pac.ensemble as ensemble

    seen = {}
    real = ensemble.PacEnsemble.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.update(device=self.device, dtype=next(self.model.parameters()).dtype)

    monkeypatch.setattr(ensemble.PacEnsemble, "__init__", spy)
    result = evaluate_pac(cfg, str(tmp_path / "w"), heldout=str(data))
    assert seen == {"device": torch.device("cpu"), "dtype": torch.bfloat16}
    assert result["m"] == 2 and result["utility"]["positions"] == 4
    assert "Return" not in json.dumps(result)


def test_a_requested_synth_dtype_names_its_own_shards():
    """Shards of a bf16 run are never resumed into an fp32 one (and resources never matter)."""
    from privcode.synth.pipeline import work_key

    meta = {"files": {"adapter/adapter_model.safetensors": "ab" * 32}}
    default = work_key(SynthConfig(), meta)
    assert work_key(SynthConfig(dtype="bfloat16"), meta) != default
    assert work_key(SynthConfig(dtype="float32"), meta) != work_key(
        SynthConfig(dtype="bfloat16"), meta
    )
    assert work_key(SynthConfig(filter_gpus=1, filter_cpus=2), meta) == default
