"""The audit stage: every privacy audit of a trained run, inside the private boundary.
Design notes: docs/audits.md, "privcode/audit/run.py".

Audited models: the DP junior release, the premium model when its stage ran, and with
``audit.compare_nondp`` a ``nondpft`` comparison fine-tuned WITHOUT DP
(:mod:`privcode.train.nondp`): written under ``audit/nondpft/`` only, marked NOT PRIVATE, never
released. Audits (``audit.audits``): canary leakage and exposure, membership inference (the
public base as reference; the DP ceiling at the junior's (epsilon, delta)), fidelity, leak
probing. ``audit.json`` holds aggregates only; ``private/<model>/canaries_private.json`` and
``probe/<model>/probe_leaks.json`` are the only files holding private values (mode 0600,
marked PRIVATE). Models load on the auditing process's device in ``audit.dtype``
(:func:`privcode.models.placement.placement`); ``audit.use_gpu`` where no CUDA device is
visible is an error naming the key, never a CPU run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import torch

from privcode.audit.canaries import canary_leakage
from privcode.audit.exposure import canary_exposure
from privcode.audit.fidelity import fidelity_report, read_private_codes, read_synthetic_codes
from privcode.audit.mia import dp_tpr_ceiling, plot_roc, read_dp_params, run_mia
from privcode.audit.probe.backends import HFBackend
from privcode.audit.probe.run import run_probe
from privcode.audit.scoring import load_scored_model
from privcode.config import PipelineConfig
from privcode.data.records import read_records
from privcode.errors import PrivcodeError
from privcode.models.placement import Placement, gpu_options, placement
from privcode.utils import atomic_write_json, torch_threads

log = logging.getLogger("privcode.audit")

__all__ = ["model_task_options", "run_audits"]


def _placement(cfg: PipelineConfig) -> Placement:
    """Where this process runs the audited models (see the module docstring)."""
    return placement(cfg.audit.use_gpu, cfg.audit.dtype, "audit.use_gpu")


def _load(path: Any, where: Placement) -> Any:
    return load_scored_model(str(path), device=where.device, dtype=where.dtype)


def _model_audits(
    name: str,
    path: Path,
    cfg: PipelineConfig,
    run: dict[str, Path],
    out_dir: Path,
    reference: Any,
    dp: dict[str, Any] | None,
    reference_cache: dict[Any, Any],
    where: Placement,
) -> dict[str, Any]:
    a = cfg.audit
    model = _load(path, where)
    result: dict[str, Any] = {"path": str(path), "non_private": name == "nondpft"}
    private = out_dir / "private" / name  # not inside a model dir: releases list their files
    private.mkdir(parents=True, exist_ok=True)
    if "canaries" in a.audits:
        with torch_threads(1):  # generation-bound small batches: threads only contend
            leak = canary_leakage(
                model,
                run["canaries"],
                samples_per_context=a.canary_samples,
                max_new_tokens=a.canary_max_new_tokens,
                seed=a.seed,
                details_path=private / "canaries_private.json",
            )
        table = []
        for placement, by_reps in sorted(leak["rates"]["by_placement_repetitions"].items()):
            for reps, rate in sorted(by_reps.items(), key=lambda kv: int(kv[0])):
                cells = [
                    c
                    for c in leak["categories"]
                    if c["placement"] == placement and str(c["repetitions"]) == reps
                ]
                table.append(
                    {
                        "placement": placement,
                        "repetitions": int(reps),
                        "rate": rate,
                        "leaked": sum(c["leaked"] for c in cells),
                        "categories": len(cells),
                    }
                )
        result["canaries"] = {
            "leaked": leak["leaked"],
            "total": leak["total"],
            "rate": leak["rates"]["overall"],
            "table": table,
            "generations": leak.get("generations"),
            "seconds": leak.get("seconds"),
        }
    if "exposure" in a.audits:
        exp = canary_exposure(
            model, run["canaries"], num_candidates=a.exposure_candidates, seed=a.seed
        )
        bits = [c["exposure"] for c in exp["canaries"]]
        result["exposure"] = {
            "candidates": a.exposure_candidates,
            "max_possible_bits": exp["max_exposure_bits"],
            "mean_bits": sum(bits) / len(bits) if bits else None,
            "max_bits": max(bits) if bits else None,
            "top_rank_count": sum(c["rank"] == 1 for c in exp["canaries"]),
            "by_cell": exp.get("mean_exposure"),
            "seconds": exp.get("seconds"),
        }
    if "mia" in a.audits:
        extra = (
            {"epsilon": dp["epsilon"], "delta": dp["delta"], "history": dp["history"]}
            if dp and name != "nondpft"
            else {}
        )
        mia = run_mia(
            model,
            reference,
            run["train"],
            run["heldout"],
            max_per_side=a.mia_records or None,
            seed=a.seed,
            reference_cache=reference_cache,
            **extra,
        )
        result["mia"] = mia
    return result


def run_audits(
    cfg: PipelineConfig,
    out_dir: Path,
    run: dict[str, Path],
    models: dict[str, Path],
    pending: dict[str, Callable[[float | None], bool]] | None = None,
) -> dict[str, Any]:
    """Run ``cfg.audit.audits`` on ``models``; ``run`` names the run's files.

    ``pending``: models still being written (the audit stage starts while the
    premium model trains: :func:`privcode.pipeline.stage.wait_input`), each
    with ``ready(timeout) -> bool`` (``timeout`` None: block until written);
    they are audited once ready, the others first.

    ``run``: ``canaries``, ``train``, ``heldout`` (data stage), ``base`` (the
    public base model directory), ``release`` (the DP junior release; its
    privacy record gives the ceiling), ``synthetic`` (optional). Returns the
    aggregate summary (also written to ``audit.json``).
    """

    started = time.time()
    a = cfg.audit
    out_dir = Path(out_dir)
    dp = read_dp_params(run["release"]) if run.get("release") else None
    summary: dict[str, Any] = {"models": {}, "audits": list(a.audits)}
    probed = [n for n in a.probe_models if n in models] if "probe" in a.audits else []
    if "probe" in a.audits and not probed:
        log.warning("leak probing: none of audit.probe_models %s was audited", list(a.probe_models))
    pending = pending or {}
    if a.cpus_per_model > 0 and _ray_ready():
        summary["models"] = _audit_in_tasks(cfg, run, out_dir, models, dp, probed, pending)
        if FIDELITY in summary["models"]:  # computed in a task of its own, first
            summary["fidelity"] = summary["models"].pop(FIDELITY)["fidelity"]
    else:
        where = _placement(cfg)
        reference = _load(run["base"], where) if "mia" in a.audits else None
        reference_cache: dict[Any, Any] = {}  # the base's MIA losses, scored once per format
        for name, path in sorted(models.items(), key=lambda kv: kv[0] in pending):
            if name in pending:
                pending[name](None)
            log.info("auditing %s", name)
            summary["models"][name] = _model_audits(
                name, path, cfg, run, out_dir, reference, dp, reference_cache, where
            )
        for name in probed:
            summary["models"][name]["probe"] = _probe(
                models[name], run, out_dir / "probe" / name, cfg, where
            )
    mia = {n: m["mia"] for n, m in summary["models"].items() if "mia" in m}
    if mia:
        curves = {
            f"{model} / {attack}": r
            for model, res in mia.items()
            for attack, r in res.get("attacks", {}).items()
        }
        plot_roc(
            curves,
            out_dir / "mia_roc.png",
            epsilon=dp["epsilon"] if dp else None,
            delta=dp["delta"] if dp else None,
        )
        for m in summary["models"].values():
            if "mia" in m:
                m["mia"] = _mia_summary(m["mia"])
    if dp:
        summary["dp_bound"] = {
            "epsilon": dp["epsilon"],
            "delta": dp["delta"],
            "tpr_at_1pct_fpr": float(dp_tpr_ceiling(0.01, dp["epsilon"], dp["delta"])),
        }
    if "fidelity" in a.audits and run.get("synthetic") and "fidelity" not in summary:
        summary["fidelity"] = _fidelity(cfg, run, out_dir)
    summary["seconds"] = round(time.time() - started, 1)
    atomic_write_json(out_dir / "audit.json", summary)
    return summary


def _ray_ready() -> bool:
    return ray.is_initialized()


def _fidelity(cfg: PipelineConfig, run: dict[str, Path], out_dir: Path) -> dict[str, Any]:
    return fidelity_report(
        read_synthetic_codes(run["synthetic"]),
        read_private_codes(run["train"]),
        out_dir / "fidelity",
        max_samples=cfg.audit.fidelity_max_samples,
        seed=cfg.audit.seed,
    )


#: The job name of the fidelity audit among the model tasks (it audits no model).
FIDELITY = "<fidelity>"


def _audit_one(
    name: str,
    path: Path | None,
    cfg: PipelineConfig,
    run: dict[str, Path],
    out_dir: Path,
    dp: dict[str, Any] | None,
    part: str,
) -> dict[str, Any]:
    """One model's audits (``part`` "audits"), its leak probing ("probe"), or the
    synthetic data's fidelity ("fidelity"): the body of one Ray task."""

    with torch_threads(int(cfg.audit.cpus_per_model)):
        if part == "fidelity":
            return {"fidelity": _fidelity(cfg, run, out_dir)}
        where = _placement(cfg)  # this task's GPU (model_task_options) or the CPU
        if part == "probe":
            return {"probe": _probe(path, run, out_dir / "probe" / name, cfg, where)}
        reference = _load(run["base"], where) if "mia" in cfg.audit.audits else None
        return _model_audits(name, path, cfg, run, out_dir, reference, dp, {}, where)


def model_task_options(cfg: PipelineConfig, name: str, part: str) -> dict[str, Any]:
    """Ray options of the task auditing ``name`` (``part``: audits, probe or fidelity).

    ``audit.cpus_per_model`` CPUs; one GPU with ``audit.use_gpu`` for the tasks
    that run a model (not the fidelity task: its small embedder runs anywhere).
    """
    gpus = 1.0 if cfg.audit.use_gpu and part != "fidelity" else 0.0
    return {
        "name": f"privcode:audit:{name}:{part}",
        "num_cpus": cfg.audit.cpus_per_model,
        **gpu_options(gpus),
    }


def _audit_in_tasks(
    cfg: PipelineConfig,
    run: dict[str, Path],
    out_dir: Path,
    models: dict[str, Path],
    dp: dict[str, Any] | None,
    probed: list[str],
    pending: dict[str, Callable[[float | None], bool]],
) -> dict[str, dict[str, Any]]:
    """Every model audited in its own Ray task of ``audit.cpus_per_model`` CPUs, side by side.

    A probed model's leak probing is a task of its own; the fidelity task (``FIDELITY``) comes
    first, then the probed models, ``pending`` ones once ready. While a model is pending only
    one task runs at a time (the audit stage's footprint), then all remaining ones are
    submitted. Each task scores the public base for its MIA itself.
    Design notes: docs/audits.md, "privcode/audit/run.py".
    """

    task = ray.remote(_audit_one)

    def jobs(name: str) -> list[tuple[str, str]]:
        return [(name, "audits"), *([(name, "probe")] if name in probed else [])]

    queue = [
        j
        for n in sorted((n for n in models if n not in pending), key=lambda n: n not in probed)
        for j in jobs(n)
    ]
    if "fidelity" in cfg.audit.audits and run.get("synthetic"):
        queue.insert(0, (FIDELITY, "fidelity"))  # short, and needs no model: first
    waiting = [n for n in models if n in pending]
    refs: dict[tuple[str, str], Any] = {}
    in_flight: list[Any] = []
    try:
        while queue or waiting:
            block = not (in_flight or queue)  # nothing else to do: wait for the model
            for name in [n for n in waiting if pending[n](None if block else 0)]:
                waiting.remove(name)
                queue[:0] = jobs(name)
            while queue and not (waiting and in_flight):  # one at a time while one is pending
                name, part = job = queue.pop(0)
                log.info("auditing %s (Ray task%s)", name, "" if part == "audits" else f": {part}")
                refs[job] = task.options(**model_task_options(cfg, name, part)).remote(
                    name, models.get(name), cfg, run, out_dir, dp, part
                )
                in_flight.append(refs[job])
            if waiting and in_flight:
                _, in_flight = ray.wait(in_flight, num_returns=1, timeout=1.0)
        done: dict[str, dict[str, Any]] = {}
        for (name, _), result in zip(refs, ray.get(list(refs.values())), strict=True):
            done.setdefault(name, {}).update(result)
    except BaseException as exc:
        for ref in refs.values():
            ray.cancel(ref, force=True)
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, PrivcodeError):
            raise exc.cause from None  # a user-facing error reads as itself
        raise
    return {name: done[name] for name in (*models, *([FIDELITY] if FIDELITY in done else []))}


def _mia_summary(result: dict[str, Any]) -> dict[str, Any]:
    attacks = {}
    for attack, r in result.get("attacks", {}).items():
        checks = (result.get("dp") or {}).get("checks", {}).get(attack, {})
        attacks[attack] = {
            k: r.get(k)
            for k in ("auc", "tpr_at_1pct_fpr", "tpr_at_10pct_fpr", "n_members", "n_nonmembers")
        }
        attacks[attack]["dp_violation"] = bool(checks.get("violated"))
    return {
        "attacks": attacks,
        "violated": bool(result.get("violated")),
        "dropped_canary_records": result.get("dropped_canary_records"),
        "seconds": result.get("seconds"),
    }


def _probe(
    path: Path,
    run: dict[str, Path],
    out_dir: Path,
    cfg: PipelineConfig,
    where: Placement | None = None,
) -> dict:
    where = where or _placement(cfg)
    # HFBackend's defaults are the CPU in float32: only another placement is passed.
    default = where == Placement(torch.device("cpu"), torch.float32)
    options = {} if default else {"device": str(where.device), "dtype": where.dtype}
    backend = HFBackend(str(path), **options)
    try:
        summary = run_probe(
            backend,
            read_records(run["train"]),
            out_dir=out_dir,
            scenarios=cfg.audit.probe_scenarios or None,
            n_questions=cfg.audit.probe_questions,
            rounds=cfg.audit.probe_rounds,
            seed=cfg.audit.seed,
            public_model=str(run["base"]),
            code_max_tokens=cfg.audit.probe_max_tokens,
            test_max_tokens=cfg.audit.probe_max_tokens * 3 // 2,
            device=str(where.device),
            dtype=where.dtype,
        )
    finally:
        backend.close()
    per_category = {}
    for category, entry in summary["metrics"].items():
        per_category[category] = {
            "responses": entry["responses"],
            "LP-1": (entry.get("LP>=1") or {}).get("rate"),
            "LP-2": (entry.get("LP>=2") or {}).get("rate"),
            "IL-2": (entry.get("IL>=2") or {}).get("rate"),
        }
    if "all" in per_category:
        per_category["all"]["confirmed"] = summary["confirmed"].get("instances")
    return {"per_category": per_category, "confirmed": summary["confirmed"].get("instances")}
