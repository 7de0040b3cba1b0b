"""GPU paths (issue 19, point 3): ``make test-gpu`` runs these where CUDA exists.

Every test is marked ``gpu`` and skipped without a CUDA device; they are
written for one H100/H200-class GPU and the ``ci`` base model (seconds each):

* one DP-SGD step (clipped per-record sum, noise off) on the GPU equals the
  CPU step: fp32 within rtol 1e-4 / atol 1e-6 on the weight update (only the
  reduction order differs; TF32 is off for the comparison), bf16 autocast
  within bf16's precision (cosine >= 0.99, norm within 5%);
* Ray Train's process group for one GPU worker is NCCL, and a collective runs;
* generation through the junior release and the Stage II generator actor on
  CUDA in bf16 (weights bf16 on the GPU, D(z) in fp32, seeded output);
* PAC batched decoding (m + 1 rows, KV cache) on CUDA: fp32 log-probs equal
  the CPU's, bf16 keeps the public top candidate;
* eval, audit and pac placing their models on the GPU they reserved, in the
  resolved ``auto`` dtype (bf16): the inline stage paths and the Ray tasks
  asking for one GPU (audit per-model tasks, PAC group and evaluation tasks).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from privcode.config import PacConfig, TrainConfig, load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ADD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """24 small private-looking records (JSONL) for the DP step, the audit and the worlds."""
    from privcode.data.records import write_records

    path = tmp_path_factory.mktemp("gpu-data") / "train.jsonl"
    write_records(
        [
            {
                "id": f"r{i}",
                "prompt": f"Return {i} plus x.",
                "code": f"def add_{i}(x):\n    return x + {i}\n",
            }
            for i in range(24)
        ],
        path,
    )
    return path


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 (as on the CPU) for the equality checks."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# --------------------------------------------------------------------------- DP-SGD


def _dp_step(base: str, records_path, device: str, dtype: str) -> torch.Tensor:
    """The weight update of one engine step: clipped per-record sum (C = 1), noise off."""
    from privcode.data.records import read_records
    from privcode.dp.engine import Privacy, make_private
    from privcode.models.encoding import collate, encode_records
    from privcode.models.loading import resolve_dtype
    from privcode.train.build import build_objective
    from privcode.train.methods import get_method

    cfg = TrainConfig(method="dpft", lora_r=4, lora_alpha=8, lora_dropout=0.0, dtype=dtype, seed=0)
    dev = torch.device(device)
    objective, tokenizer, _ = build_objective(
        get_method("dpft"), cfg, base, dev, will_restore=False
    )
    params = [p for p in objective.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)  # non-zero B (CPU draws): every LoRA weight moves
    with torch.no_grad():
        for name, p in objective.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    before = torch.cat([p.detach().reshape(-1).cpu().clone() for p in params])
    assert {p.dtype for p in params} == {torch.float32}  # trainable weights stay fp32
    encoded = encode_records(read_records(records_path), tokenizer, 32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    optimizer = torch.optim.SGD(params, lr=0.5)
    # The non-private mode with a clip norm is DP-SGD's clipped sum with the noise off; its
    # fixed seed samples the same Poisson batch on both devices.
    privacy = Privacy.non_private("gpu equality test", seed=7, max_grad_norm=1.0)
    engine = make_private(
        objective,
        optimizer,
        privacy,
        num_records=len(encoded),
        sample_rate=0.5,
        device=dev,
        autocast_dtype=resolve_dtype(dtype, dev),
    )

    def batch_fn(local, step):
        return collate(
            [encoded[j] for j in local],
            pad,
            device=dev,
            step=step,
            record_keys=torch.tensor([1000 + j for j in local], dtype=torch.long),
            record_secret=engine.randomness.record_secret(step),
        )

    assert engine.step(0, batch_fn, lambda module, batch: module(batch)).taken
    after = torch.cat([p.detach().reshape(-1).cpu() for p in params])
    return after - before


def test_dp_sgd_step_on_gpu_equals_cpu_step(ci_model, corpus, no_tf32):
    cpu = _dp_step(ci_model, corpus, "cpu", "float32")
    gpu = _dp_step(ci_model, corpus, "cuda", "float32")
    assert cpu.abs().sum() > 0  # the step moved the weights
    torch.testing.assert_close(gpu, cpu, rtol=1e-4, atol=1e-6)


def test_dp_sgd_bf16_autocast_step_on_gpu_is_close_to_fp32(ci_model, corpus, no_tf32):
    cpu = _dp_step(ci_model, corpus, "cpu", "float32")
    half = _dp_step(ci_model, corpus, "cuda", "bfloat16")  # bf16 base, fp32 LoRA and sums
    cosine = torch.nn.functional.cosine_similarity(half.double(), cpu.double(), dim=0)
    assert cosine >= 0.99, float(cosine)
    assert abs(half.norm() / cpu.norm() - 1) <= 0.05


# --------------------------------------------------------------------------- NCCL


def test_ray_train_gpu_worker_uses_nccl(ray_connected, tmp_path):
    from privcode.models.ray_train import fit, torch_trainer

    def loop(config):
        import json

        import ray.train
        import torch
        import torch.distributed as dist

        t = torch.ones(3, device=ray.train.torch.get_device())
        dist.all_reduce(t)
        seen = {
            "backend": dist.get_backend(),
            "world": dist.get_world_size(),
            "sum": float(t.sum().item()),
            "device": str(t.device),
        }
        with open(config["out"], "w", encoding="utf-8") as f:  # Ray Train v2 keeps metrics
            json.dump(seen, f)  # only with checkpoints: the worker writes what it saw
        ray.train.report(seen)

    out = tmp_path / "seen.json"
    trainer = torch_trainer(
        loop,
        {"out": str(out)},
        name="nccl",
        storage=tmp_path,
        num_workers=1,
        cpus_per_worker=1,
        use_gpu=True,
        max_failures=0,
    )
    fit(trainer, 1, 1)
    metrics = json.loads(out.read_text(encoding="utf-8"))
    assert metrics["backend"] == "nccl" and metrics["world"] == 1
    assert metrics["sum"] == 3.0 and metrics["device"].startswith("cuda")


# --------------------------------------------------------------------------- release


def test_release_generates_on_cuda_in_bf16(ci_release):
    from privcode.models.junior import load_release
    from privcode.synth.operators import Generate

    rel = load_release(ci_release, device="cuda", dtype=torch.bfloat16)
    weights = {(p.device.type, p.dtype) for p in rel.model.parameters()}
    assert weights == {("cuda", torch.bfloat16)}
    assert rel.prefix_decoder.weight.dtype == torch.float32
    texts = rel.generate(n=8, max_new_tokens=16, temperature=0.8, seed=3)
    assert len(texts) == 8 and all(isinstance(t, str) for t in texts)
    assert rel.generate(n=8, max_new_tokens=16, temperature=0.8, seed=3) == texts  # seeded
    # Teacher-forced next-token distributions of the bf16 GPU junior vs the fp32 CPU one.
    full = load_release(ci_release)
    ids = full.tokenizer(ADD, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(full.model(input_ids=ids).logits.float(), -1)
        got = torch.log_softmax(rel.model(input_ids=ids.cuda()).logits.float(), -1).cpu()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    assert agree >= 0.9, float(agree)
    # The Stage II generator actor (synth.gpus_per_generator > 0) in synth.dtype auto.
    opts = {"gpu": True, "dtype": "auto", "seed": 0, "max_new_tokens": 8}
    gen = Generate(str(ci_release), {**opts, "temperature": 0.8, "top_p": 0.95}, [])
    assert gen.placement["device"].startswith("cuda") and gen.placement["dtype"] == "bfloat16"
    out = gen({"index": np.arange(4), "z_seed": np.array(["0:0"] * 4, dtype=object)})
    assert len(out["code"]) == 4


def test_hf_filters_on_their_gpu(ci_model):
    from privcode.synth.operators import Extract, RoundTripScore

    llm = {"gpu": True, "dtype": "auto", "key": "synth.filter_gpus"}
    ex = Extract("hf", {"model": ci_model, "max_new_tokens": 8}, llm)
    out = ex({"code": np.array([ADD], dtype=object), "cond_prompt": np.array([""], dtype=object)})
    assert isinstance(out["prompt"][0], str)
    model = ex.extractor.generator._model
    assert model.device.type == "cuda" and model.dtype == torch.bfloat16
    models = {"summarizer_model": ci_model, "scorer_model": ci_model}
    rt = RoundTripScore("hf", "bertscore", 0.5, models, llm)
    score = rt.filter.score(["Add two numbers."], [ADD])
    assert len(score) == 1 and -1.0 <= score[0] <= 1.0
    assert rt.filter.scorer._model.device.type == "cuda"
    assert rt.filter.scorer._model.dtype == torch.bfloat16


# --------------------------------------------------------------------------- PAC


@pytest.fixture(scope="module")
def worlds(ci_model, corpus, tmp_path_factory):
    """4 worlds trained on the GPU (bf16 base, fp32 LoRA), inline as the pac stage does."""
    from privcode.pac.worlds import train_worlds

    out = tmp_path_factory.mktemp("gpu-worlds")
    cfg = PacConfig(worlds=4, steps=6, batch_size=2, lr=1e-2, max_length=32, lora_r=2, use_gpu=True)
    with pytest.warns(RuntimeWarning, match="WITHOUT DP"):
        summary = train_worlds(cfg, data=corpus, base=ci_model, out_dir=out, progress=False)
    assert summary["groups"][0]["device"].startswith("cuda")
    return out


def test_pac_worlds_adapters_are_fp32_after_gpu_training(worlds):
    from safetensors.torch import load_file

    for w in ("w000", "w003"):
        weights = load_file(str(worlds / "adapters" / w / "adapter_model.safetensors"))
        assert {t.dtype for t in weights.values()} == {torch.float32}
        assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_B" in k)


def test_pac_batched_decoding_on_cuda(worlds, no_tf32):
    from privcode.pac.ensemble import PacEnsemble
    from privcode.pac.evaluate import KnownSecretCurator

    cpu = PacEnsemble(worlds, device="cpu", top_k=8)
    gpu = PacEnsemble(worlds, device="cuda", top_k=8, dtype=torch.float32)
    half = PacEnsemble(worlds, device="cuda", top_k=8)  # bf16 on a bf16 GPU
    assert next(half.model.parameters()).dtype == torch.bfloat16
    ids = cpu.encode(ADD)
    # Teacher-forced, every row (m worlds + the public base) over the whole vocabulary.
    public_cpu, worlds_cpu = cpu.sequence_logprobs(ids)
    public_gpu, worlds_gpu = gpu.sequence_logprobs(ids)
    torch.testing.assert_close(public_gpu, public_cpu, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(worlds_gpu, worlds_cpu, rtol=1e-4, atol=1e-4)
    # Batched decoding with the rows' KV caches on the GPU: prefill, then one cached step,
    # equal to the teacher-forced pass at those positions.
    step, past = gpu.step_logprobs(ids[:-1])
    cand = torch.as_tensor(step.candidates)
    np.testing.assert_allclose(step.public, public_gpu[-2, cand].double().numpy(), atol=1e-4)
    np.testing.assert_allclose(step.worlds, worlds_gpu[:, -2, cand].double().numpy(), atol=1e-4)
    step, _ = gpu.step_logprobs(ids[-1:], past)
    cand = torch.as_tensor(step.candidates)
    np.testing.assert_allclose(step.worlds, worlds_gpu[:, -1, cand].double().numpy(), atol=1e-4)
    assert int(cand[0]) == int(public_cpu[-1].argmax())
    top, _ = half.step_logprobs(ids)
    assert int(top.candidates[0]) == int(public_cpu[-1].argmax())  # bf16 keeps the top token
    runs = []
    for ens in (gpu, gpu, half):
        curator = KnownSecretCurator(ens.m, 2.0**-8, 1, np.random.default_rng(0))
        runs.append(ens.generate(curator, "s", ADD, 12))
    assert runs[0].token_ids == runs[1].token_ids  # deterministic on the device
    assert all(1 <= len(r.token_ids) <= 12 for r in runs)
    assert all(
        r.private_tokens + r.free_tokens + r.fallback_tokens == len(r.token_ids) for r in runs
    )


def _spy_ensembles(monkeypatch) -> list[tuple[str, torch.dtype]]:
    import privcode.pac.ensemble as ensemble

    seen: list[tuple[str, torch.dtype]] = []
    real = ensemble.PacEnsemble.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append((self.device.type, next(self.model.parameters()).dtype))

    monkeypatch.setattr(ensemble.PacEnsemble, "__init__", spy)
    return seen


def test_pac_evaluation_on_the_gpu_in_bf16(worlds, corpus, monkeypatch):
    from privcode.pac.evaluate import evaluate_pac

    seen = _spy_ensembles(monkeypatch)
    cfg = PacConfig(
        worlds=4,
        use_gpu=True,
        eval_sessions=2,
        eval_tokens=4,
        eval_positions=8,
        eval_canaries=0,
        max_length=32,
    )
    result = evaluate_pac(cfg, str(worlds), heldout=str(corpus))
    assert seen == [("cuda", torch.bfloat16)]
    assert result["m"] == 4 and result["utility"]["positions"] == 8


def test_pac_groups_and_evaluation_in_gpu_tasks(ray_connected, ci_model, corpus, tmp_path):
    """world_groups 2: each group's Ray task and the evaluation's own task reserve one GPU
    (the driver's view of CUDA is hidden so the evaluation goes to its task)."""
    from privcode.pac.evaluate import evaluate_pac
    from privcode.pac.worlds import train_worlds

    cfg = PacConfig(
        worlds=4,
        world_groups=2,
        steps=2,
        batch_size=2,
        max_length=24,
        lora_r=2,
        use_gpu=True,
        eval_sessions=1,
        eval_tokens=2,
        eval_positions=4,
        eval_canaries=0,
    )
    with pytest.warns(RuntimeWarning):
        summary = train_worlds(cfg, data=corpus, base=ci_model, out_dir=tmp_path, progress=False)
    assert [g["device"][:4] for g in summary["groups"]] == ["cuda", "cuda"]
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.cuda, "is_available", lambda: False)  # this process only
    try:
        result = evaluate_pac(cfg, str(tmp_path), heldout=str(corpus))
    finally:
        mp.undo()
    assert result["m"] == 4 and result["utility"]["positions"] == 4


# --------------------------------------------------------------------------- eval, audit


def test_eval_generates_on_the_gpu_in_bf16(ci_model, ci_release):
    from privcode.eval.benchmarks import Problem
    from privcode.eval.completions import generate_completions, load_generator
    from privcode.models.placement import placement

    where = placement(True, "auto", "eval.use_gpu")
    assert where.cuda and where.dtype == torch.bfloat16
    problem = Problem("t/0", "def add(a, b):\n", "assert add(1, 2) == 3\n", "add", "humaneval")
    for model in (ci_model, ci_release):
        gen = load_generator(model, device=str(where.device), dtype=where.dtype)
        assert gen.info["dtype"] == "bfloat16" and gen.info["device"].startswith("cuda")
        assert {p.device.type for p in gen.model.parameters()} == {"cuda"}
        samples = generate_completions(gen, [problem], n=2, temperature=0.8, max_new_tokens=8)
        assert len(samples) == 2


def _audit_run(ci_model, ci_release, corpus, tmp_path):
    from privcode.data.records import read_records, write_records

    records = read_records(corpus)
    heldout = tmp_path / "heldout.jsonl"
    write_records(
        [{"id": f"h{i}", "prompt": r.prompt, "code": r.code + "\n"} for i, r in enumerate(records)],
        heldout,
    )
    return {"release": ci_release, "base": ci_model, "train": corpus, "heldout": heldout}


def test_audit_models_on_the_gpu_in_bf16(ci_model, ci_release, corpus, tmp_path, monkeypatch):
    import privcode.audit.run as audit_run

    seen = []
    real = audit_run.load_scored_model

    def spy(path, **kwargs):
        model = real(path, **kwargs)
        weight = model.model.get_input_embeddings().weight
        seen.append((weight.device.type, weight.dtype))
        return model

    monkeypatch.setattr(audit_run, "load_scored_model", spy)
    cfg = load_config(None, overrides=["audit.use_gpu=true", "audit.audits=[mia]"])
    run = _audit_run(ci_model, ci_release, corpus, tmp_path)
    summary = audit_run.run_audits(cfg, tmp_path / "audit", run, {"junior": ci_release})
    assert seen == [("cuda", torch.bfloat16)] * 2  # the reference (base) and the junior
    auc = summary["models"]["junior"]["mia"]["attacks"]["loss"]["auc"]
    assert 0.0 <= auc <= 1.0


def test_audit_per_model_tasks_reserve_a_gpu(ray_connected, ci_model, ci_release, corpus, tmp_path):
    from privcode.audit.run import run_audits

    cfg = load_config(
        None, overrides=["audit.use_gpu=true", "audit.audits=[mia]", "audit.cpus_per_model=1"]
    )
    run = _audit_run(ci_model, ci_release, corpus, tmp_path)
    # A task without a GPU would fail with the DevicePlacementError naming audit.use_gpu.
    summary = run_audits(cfg, tmp_path / "audit", run, {"junior": ci_release})
    assert 0.0 <= summary["models"]["junior"]["mia"]["attacks"]["loss"]["auc"] <= 1.0
