"""The stages that read the private records after Stage I: audits, the non-DP comparison, PAC.

Part of the stage table :data:`privcode.pipeline.stages.STAGES` (see there);
all three are ``private``: their artifacts stay inside the privacy boundary.
"""

from __future__ import annotations

from pathlib import Path

from privcode.artifacts.nondp import NondpSummary
from privcode.artifacts.summaries import AuditSummary, PacSummary
from privcode.layout import RunLayout
from privcode.pipeline.report_audit import audit_report
from privcode.pipeline.report_pac import pac_report
from privcode.pipeline.stage import (
    NONDP_TRAIN_FIELDS,
    Stage,
    Workers,
    base_path,
    summary_of,
    wait_input,
)
from privcode.privacy.store import open_pinned
from privcode.utils import atomic_write_json

__all__ = ["AuditStage", "NondpStage", "PacStage"]


class AuditStage(Stage):
    """Privacy audits of the run (:mod:`privcode.audit.run`), inside the private boundary.

    Canary leakage, exposure and membership inference on the DP junior (and
    the premium model, and the ``nondpft`` comparison when
    ``audit.compare_nondp``), fidelity of the synthetic data, leak probing.
    The summary holds aggregates only; the detail files with private values
    stay in this stage's directory.
    """

    name = "audit"
    summary_type = AuditSummary
    version = 1
    # train: the data path, and what the comparison reads when it trains inline.
    sections = ("audit", "train.data", "privacy.store_id", *NONDP_TRAIN_FIELDS)
    needs = ("data", "base", "train")
    after = ("synth", "premium", "nondp")
    late = ("premium",)  # the junior and nondpft are audited while the premium model trains
    private = True
    num_cpus = None  # scoring and generation on every CPU
    cpu_key = "audit.cpus_per_model"

    @staticmethod
    def _inline_nondp(cfg):
        return cfg.audit.compare_nondp and "nondp" not in cfg.run.stages

    @classmethod
    def cpus(cls, cfg):
        # With audit.cpus_per_model the models are audited in their own Ray tasks; the
        # stage's task only drives them (unless it trains the non-DP comparison itself).
        return 0 if cfg.audit.cpus_per_model > 0 and not cls._inline_nondp(cfg) else None

    @classmethod
    def gpu_key(cls, cfg):
        # Inline audits (no per-model tasks) score on the task's GPU; the non-DP comparison
        # trained in the task uses train.use_gpu (privcode.train.nondp).
        if cfg.audit.use_gpu and cfg.audit.cpus_per_model == 0:
            return "audit.use_gpu"
        if cls._inline_nondp(cfg) and cfg.train.use_gpu:
            return "train.use_gpu"
        return None

    @classmethod
    def workers(cls, cfg):
        if cfg.audit.cpus_per_model <= 0:
            return ()
        models = 1 + ("premium" in cfg.run.stages) + bool(cfg.audit.compare_nondp)
        gpus, cpus = 1.0 if cfg.audit.use_gpu else 0.0, cfg.audit.cpus_per_model
        return (Workers("audit model tasks", models, cpus, gpus, 1, "audit.cpus_per_model"),)

    @classmethod
    def footprint(cls, cfg):
        # Its model tasks queue in Ray for CPUs as they free up, and every Ray Train or
        # Ray Data stage it could starve (train, synth, premium, nondp) finishes before it
        # starts: it may start beside other stages once one model's task fits.
        return cfg.audit.cpus_per_model if cls.cpus(cfg) == 0 else None

    def run(self, cfg, out_dir, inputs):
        from privcode.audit.run import run_audits
        from privcode.train.nondp import train_nondp_comparison

        layout = RunLayout.of(cfg)
        train_data = Path(cfg.train.data) if cfg.train.data else layout.train_data
        run = {
            "canaries": layout.canaries,
            "train": train_data,
            "heldout": layout.heldout_data,
            "base": Path(base_path(inputs)),
            "release": layout.release,
        }
        if "synth" in inputs:
            run["synthetic"] = layout.synthetic
        models = {"junior": run["release"]}
        if "premium" in inputs:
            models["premium"] = layout.premium
        comparison = None
        if "nondp" in inputs:  # trained beside Stage I and II by the nondp stage
            comparison = summary_of(inputs, "nondp")
            models["nondpft"] = layout.nondp_model
        elif cfg.audit.compare_nondp:
            comparison = train_nondp_comparison(
                cfg, data=train_data, base=str(run["base"]), out_dir=layout.nondp_model_in(out_dir)
            )
            models["nondpft"] = layout.nondp_model_in(out_dir)
        pending = (
            {"premium": lambda timeout: wait_input(inputs, "premium", timeout) is not None}
            if "premium" in models
            else {}
        )
        summary = run_audits(cfg, Path(out_dir), run, models, pending)
        if comparison:
            summary["nondpft_training"] = comparison
        return summary

    def report_section(self, manifest, ctx):
        return audit_report(manifest, ctx)


class PacStage(Stage):
    """PAC-private generation: train the m worlds, then measure utility and leakage.

    Reads the private training records (``train.data`` or the data stage's
    ``train.parquet``) and the base model; writes ``worlds/`` (the m
    adapters, NOT private on their own: only the PAC server may read them,
    :mod:`privcode.pac.worlds`) and ``pac_eval.json``. The summary holds
    settings and aggregates only (:mod:`privcode.pac.evaluate`).
    """

    name = "pac"
    summary_type = PacSummary
    sections = (
        "pac",
        "train.data",
        "privacy.store_id",
    )  # its worlds train with pac.* settings only
    needs = ("data", "base")
    private = True
    num_cpus = None  # all worlds train in one process's batched passes
    cpu_key = "pac.num_cpus"

    @classmethod
    def cpus(cls, cfg):
        return cfg.pac.num_cpus or None

    gpu_flag = "pac.use_gpu"

    @classmethod
    def gpu_key(cls, cfg):
        # One group trains in the stage's task; more train in their own tasks, a GPU each
        # (privcode.pac.worlds).
        return super().gpu_key(cfg) if cfg.pac.world_groups == 1 else None

    @classmethod
    def workers(cls, cfg):
        n, gpus = cfg.pac.world_groups, 1.0 if cfg.pac.use_gpu else 0.0
        if n == 1:
            return ()
        groups = Workers("PAC world-group tasks", n, 1.0, gpus, 1, "pac.world_groups")
        # With GPUs the evaluation then runs in a one-GPU task of its own (the stage's task
        # holds none): privcode.pac.evaluate.eval_task_options.
        evaluation = Workers("PAC evaluation task", 1, 1.0, 1.0, 1, "pac.use_gpu")
        return (groups, evaluation) if gpus else (groups,)

    def run(self, cfg, out_dir, inputs):
        from privcode.pac.evaluate import evaluate_pac
        from privcode.pac.worlds import train_worlds

        layout = RunLayout.of(cfg)
        train_data = Path(cfg.train.data) if cfg.train.data else layout.train_data
        worlds = layout.pac_worlds_in(out_dir)

        store = open_pinned(cfg.privacy.store, cfg.privacy.store_id)
        trained = train_worlds(
            cfg.pac,
            data=train_data,
            base=base_path(inputs),
            out_dir=worlds,
            progress=False,
            store=store,  # the PAC budget is keyed by the records, not the file's bytes
        )
        canaries = layout.canaries
        result = evaluate_pac(
            cfg.pac,
            str(worlds),
            heldout=str(layout.heldout_data),
            canaries=str(canaries) if canaries.is_file() else None,
        )
        atomic_write_json(Path(out_dir) / "pac_eval.json", result)
        # The runner renames this stage's temporary directory to its own: name the final one.
        return {**result, "worlds": trained, "worlds_dir": str(layout.pac_worlds)}

    def report_section(self, manifest, ctx):
        return pac_report(manifest, ctx)


class NondpStage(Stage):
    """The audits' non-DP comparison, trained as soon as the data and base exist.

    NOT PRIVATE: the base fine-tuned WITHOUT differential privacy on the same
    private records (:mod:`privcode.train.nondp`), for the audit stage to show
    what its attacks find when nothing protects the data; never released.
    Its own stage so that it trains beside Stage I and II rather than after
    them; without it in ``run.stages`` the audit stage trains it itself.
    """

    name = "nondp"
    summary_type = NondpSummary
    sections = (
        "audit.nondp_finetune",
        "audit.nondp_steps",
        "audit.nondp_lr",
        "audit.nondp_batch_size",
        "audit.seed",
        "train.data",
        *NONDP_TRAIN_FIELDS,
    )
    needs = ("data", "base")
    private = True
    num_cpus = None
    cpu_key = "audit.nondp_cpus"

    @classmethod
    def cpus(cls, cfg):
        return cfg.audit.nondp_cpus or None

    gpu_flag = "train.use_gpu"  # privcode.train.nondp trains on it

    def run(self, cfg, out_dir, inputs):
        from privcode.train.nondp import train_nondp_comparison

        layout = RunLayout.of(cfg)
        data = Path(cfg.train.data) if cfg.train.data else layout.train_data
        return train_nondp_comparison(
            cfg, data=data, base=base_path(inputs), out_dir=layout.nondp_model_in(out_dir)
        )
