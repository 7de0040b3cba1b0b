"""Run the configured stages in order on a Ray cluster, skipping unchanged ones.
Design notes: docs/development.md, "privcode/pipeline/runner.py".

A stage's files and ``manifest.json`` (:class:`~privcode.artifacts.StageManifest`) live in
``<run.out_dir>/<run.name>/<stage>/``. Its fingerprint hashes the config it declares it reads
(:attr:`Stage.sections`), its version and the fingerprints of the stages it needs
(:data:`LOCATION_FIELDS` enter as the directory they resolve to, or not at all). It is skipped
when its manifest has the same fingerprint and every listed output its recorded sha256, and
writes into a temporary sibling that replaces the old directory only after the manifest is
written. It receives the manifests of its ``needs`` and of the ``after`` stages in the run
(run now, skipped, or read from disk when current: :func:`current_optional_inputs`). Each stage
runs as a Ray task.

"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from privcode import __version__
from privcode.artifacts import ArtifactError, StageManifest
from privcode.artifacts.manifest import hash_outputs
from privcode.config import PipelineConfig
from privcode.errors import PrivcodeError
from privcode.layout import RunLayout
from privcode.pipeline.placement import cluster_nodes, stage_resources
from privcode.pipeline.stages import STAGES, PendingInput, Stage
from privcode.pipeline.summary import run_summary
from privcode.privacy.store import StoreError, StoreIntegrityError, open_pinned, resolve_store
from privcode.utils import make_dirs, replace_dir, stable_hash, torch_threads

log = logging.getLogger("privcode.pipeline")

MANIFEST = StageManifest.FILE
#: What a stage receives per input: a manifest, or a ``late`` input still running.
Upstream = dict[str, StageManifest | PendingInput]


#: Config fields naming where a run keeps things rather than what it computes. ``make
#: submit-job`` rewrites them to absolute paths (``privcode.cluster.jobs``), so the
#: fingerprint must not see how they are spelt: True = fingerprinted as the absolute path
#: they resolve to (against the cwd, as the submit side and :class:`RunLayout` resolve
#: them); False = left out, the result does not depend on them.
LOCATION_FIELDS: dict[str, bool] = {
    "run.out_dir": True,  # read by no stage today: its manifests live under it anyway
    "run.reports_dir": True,  # where the report stage writes: a new place re-runs it
    "base.cache_dir": False,  # builds are found by content hash (models.base.config_hash)
    "privacy.store": False,  # a stage that charges the store reads privacy.store_id instead
}


def pin_locations(cfg: PipelineConfig) -> PipelineConfig:
    """``cfg`` as the driver hands it to every task: the :data:`LOCATION_FIELDS` made
    absolute against the driver's cwd, and the privacy store resolved once
    (:func:`privcode.privacy.store.resolve_store`: the driver's environment decides) with
    its keyed id in ``privacy.store_id``, so that no task resolves another store.

    A store that does not exist yet is pinned by path only (id ''): the stages that
    charge it refuse with ``privcode budget init``'s command; one whose id differs from a
    configured ``privacy.store_id`` is refused here.
    """

    store, store_id = resolve_store(cfg.privacy.store), cfg.privacy.store_id
    try:
        store_id = open_pinned(store, store_id).store_id
    except StoreIntegrityError:
        raise
    except StoreError:  # no store there yet: the stages that need one say so
        pass
    absolute = lambda p: str(Path(p).expanduser().resolve())  # noqa: E731
    return replace(
        cfg,
        run=replace(
            cfg.run, out_dir=absolute(cfg.run.out_dir), reports_dir=absolute(cfg.run.reports_dir)
        ),
        base=replace(cfg.base, cache_dir=absolute(cfg.base.cache_dir)),
        privacy=replace(cfg.privacy, store=str(store), store_id=store_id),
    )


def fingerprinted_config(cfg: PipelineConfig, stage: type[Stage]) -> dict[str, dict[str, Any]]:
    """What of ``cfg`` enters ``stage``'s fingerprint: :meth:`Stage.config_read`, with the
    :data:`LOCATION_FIELDS` it reads resolved (``runs/x`` and ``<cwd>/runs/x`` are one
    place) or left out (``base.cache_dir``: moving the cache changes no result)."""
    read = stage.config_read(cfg)
    for dotted, keep in LOCATION_FIELDS.items():
        section, _, key = dotted.partition(".")
        values = read.get(section)
        if values is None or key not in values:
            continue
        if keep:
            values[key] = str(Path(values[key]).expanduser().resolve())
        else:
            del values[key]
    return read


def fingerprint(cfg: PipelineConfig, stage: type[Stage], upstream: Upstream) -> str:
    """Hash of the stage, its version, :func:`fingerprinted_config` and its inputs' hashes.

    Left out: ``base.cache_dir`` (builds are keyed by content, so where they are cached
    changes no result); ``run.out_dir`` and ``run.reports_dir`` enter resolved
    (:data:`LOCATION_FIELDS`). A manifest written before this rule hashed them as spelt:
    it no longer matches, and the stage (with those after it) runs once more.
    """
    return stable_hash(
        {
            "stage": stage.name,
            "version": stage.version,
            "config": fingerprinted_config(cfg, stage),
            "run": None,  # (was run.name/reports_dir, now in "config"): unchanged stages keep their hash
            "inputs": {name: upstream[name].fingerprint for name in _input_names(stage, upstream)},
        }
    )


def _input_names(stage: type[Stage], available: dict[str, Any]) -> list[str]:
    """The stage's required inputs, plus its optional ones that ran earlier in this run."""
    return [*stage.needs, *(name for name in stage.after if name in available)]


def read_manifest(directory: Path) -> StageManifest | None:
    """The stage manifest in ``directory``; None when absent or unreadable (the stage runs)."""
    return StageManifest.find(directory)


def is_current(directory: Path, fp: str, stage: type[Stage] | None = None) -> bool:
    """True when the manifest matches ``fp`` and every output is intact."""
    manifest = read_manifest(directory)
    if manifest is None or manifest.fingerprint != fp:
        return False
    if stage is not None and stage.summary_type is not None:
        try:
            stage.summary_type.from_json(manifest.summary)
        except ArtifactError:
            return False  # written by a version with another summary: run again
    if stage is not None and not stage().still_valid(manifest.summary):
        return False
    return manifest.intact(directory)


def current_optional_inputs(
    cfg: PipelineConfig, stage: type[Stage], upstream: Upstream, order: list[str]
) -> dict[str, StageManifest]:
    """The optional inputs of ``stage`` this invocation does not run but finds current on disk.

    ``privcode report`` selects the report stage only; a stage of
    ``run.stages`` that it reads when present (train, synth, eval, ...) is
    passed when its artifact on disk is exactly what this config would produce
    (same fingerprint, outputs intact), as a full run would have skipped it.
    Stages are tried in table order, so an input's own optional inputs (the
    nondp stage of the audit) count towards its fingerprint first.
    """
    wanted = {n for n in stage.after if n not in order and n in cfg.run.stages}
    known: Upstream = dict(upstream)
    found: dict[str, StageManifest] = {}
    for name, other in STAGES.items():
        if not wanted - set(found):
            break
        if name in known or name in order or name not in cfg.run.stages:
            continue
        if any(dep not in known for dep in other.needs):
            continue
        directory = RunLayout.of(cfg).stage(name)
        manifest = read_manifest(directory)
        if manifest is not None and is_current(directory, fingerprint(cfg, other, known), other):
            known[name] = manifest
            if name in wanted:
                found[name] = manifest
    return found


@contextlib.contextmanager
def _stage_threads(stage: type[Stage], cfg: PipelineConfig) -> Iterator[None]:
    """torch threads = the CPUs this stage holds (every core for a stage that runs alone).

    A Ray worker process is reused across stages and torch's thread count is
    process state: without this a stage inherits whatever the previous one set
    (the audit's single thread made the next stage's training 2x slower).
    """
    cpus = stage.cpus(cfg)
    if cpus == 0:
        yield  # a stage that holds no CPU drives others (Ray Train, Ray Data, sandboxes)
        return
    cores = len(os.sched_getaffinity(0))
    with torch_threads(cores if cpus is None else max(1, min(cores, int(cpus)))):
        yield


def execute_stage(
    name: str, cfg: PipelineConfig, final_dir: str, fp: str, inputs: Upstream
) -> StageManifest:
    """Run one stage into a temporary directory, then swap it in. Returns its manifest.

    This function is what runs inside the Ray task.
    """
    final = Path(final_dir)
    make_dirs(final.parent)  # the run directory: owner-only (0700), whatever the umask
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    started = time.time()
    try:
        with _stage_threads(STAGES[name], cfg):
            summary = STAGES[name]().run(cfg, work, inputs)
        stage = STAGES[name]
        if stage.summary_type is not None:  # a renamed or missing key fails here, not later
            summary = stage.summary_type.from_json(summary, f"the {name} stage's summary").to_json()
        manifest = StageManifest(
            stage=name,
            fingerprint=fp,
            private=stage.private,
            config=stage.config_read(cfg),
            inputs={n: inputs[n].fingerprint for n in inputs},
            outputs=hash_outputs(work),
            summary=summary,
            timings={"started": started, "seconds": round(time.time() - started, 3)},
            privcode_version=__version__,
            config_source=cfg.source,
        )
        manifest.write(work / MANIFEST)
        replace_dir(work, final)
        return manifest
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _ray_resources(stage: type[Stage], cfg: PipelineConfig) -> dict[str, float]:
    """The stage task's ``num_cpus`` / ``num_gpus`` on the connected cluster: what one node
    gives (:func:`~privcode.pipeline.placement.stage_resources`; PlacementError if none can)."""
    return stage_resources(stage, cfg, cluster_nodes())


def run_pipeline(
    cfg: PipelineConfig, stages: list[str] | None = None, use_ray: bool = True
) -> dict[str, Any]:
    """Run ``stages`` (default ``cfg.run.stages``); returns a summary per stage.

    Stages not selected but needed by a selected one must already have a
    current artifact (their manifest is read); otherwise they run too. On
    Ray, a stage starts as soon as every stage it reads has finished
    (``needs``, and ``after`` when selected), so independent stages (the PAC
    worlds and the non-DP comparison beside Stage I and II) run side by side
    on the CPUs they ask for; ``run.parallel: false`` runs one at a time.
    """
    started = time.time()
    cfg = pin_locations(cfg)  # every task gets the driver's paths and store
    selected = list(stages or cfg.run.stages)
    for name in selected:
        if name not in STAGES:
            raise PrivcodeError(f"unknown stage '{name}' (known: {', '.join(STAGES)})")
    order = _with_dependencies(selected)
    resources: dict[str, dict[str, float]] = {}
    if use_ray:
        from privcode.cluster.local import connect

        cluster = connect(cfg.run.ray_address or None)
        log.info("running on Ray cluster %s", cluster.get("address"))
        nodes = cluster_nodes()  # every stage's placement checked before any stage starts
        resources = {n: stage_resources(STAGES[n], cfg, nodes) for n in order}
        from privcode.pipeline.admission import preflight

        verdict = preflight(cfg, order)  # BudgetRefused before any stage starts
        if verdict:
            _say(f"privacy budget: {verdict}")
    results: dict[str, dict[str, Any]] = {}
    manifests: dict[str, StageManifest] = {}
    pending = list(order)
    running: dict[Any, tuple[str, str, float]] = {}  # ray ref -> (stage, fingerprint, start)
    parallel = use_ray and cfg.run.parallel
    try:
        while pending or running:
            progressed = False  # a start or skip may make another stage ready: rescan
            for name in [n for n in pending if _ready(n, order, manifests, running)]:
                if running and not (parallel and _fits(STAGES[name], cfg, running)):
                    continue  # a later ready stage may still fit beside the running ones
                pending.remove(name)
                stage = STAGES[name]
                for other, manifest in current_optional_inputs(
                    cfg, stage, manifests, order
                ).items():
                    manifests[other] = manifest
                    results[other] = {
                        "status": "skipped",
                        "dir": str(RunLayout.of(cfg).stage(other)),
                        "fingerprint": manifest.fingerprint,
                    }
                    _say(f"[{other}] not selected, current on disk: read for {name}")
                upstream: Upstream = {**manifests, **_late_inputs(stage, running)}
                fp = fingerprint(cfg, stage, upstream)
                directory = RunLayout.of(cfg).stage(name)
                current = read_manifest(directory) if is_current(directory, fp, stage) else None
                if current is not None and not (cfg.run.force and name in selected):
                    manifests[name] = current
                    results[name] = {"status": "skipped", "dir": str(directory), "fingerprint": fp}
                    _say(f"[{name}] unchanged, skipped ({directory})")
                    progressed = True
                    continue
                _say(f"[{name}] running ...")
                inputs = {n: upstream[n] for n in _input_names(stage, upstream)}
                if not use_ray:
                    t0 = time.time()
                    manifests[name] = execute_stage(name, cfg, str(directory), fp, inputs)
                    _done(results, name, directory, fp, t0)
                    progressed = True
                    continue
                import ray

                task = ray.remote(execute_stage).options(name=f"privcode:{name}", **resources[name])
                ref = task.remote(name, cfg, str(directory), fp, inputs)
                running[ref] = (name, fp, time.time())
                progressed = True
            if progressed:
                continue
            if not running:
                if pending and not any(_ready(n, order, manifests, running) for n in pending):
                    # cannot happen for a valid stage table; never spin
                    raise PrivcodeError(f"stages {pending} wait on stages that never run")
                continue
            import ray

            (ref,), _ = ray.wait(list(running), num_returns=1)
            name, fp, t0 = running.pop(ref)
            manifests[name] = _get(ref)
            _done(results, name, RunLayout.of(cfg).stage(name), fp, t0)
    except BaseException:
        if running:
            import ray

            for ref in running:  # a failed stage stops its siblings: no half-run pipeline
                ray.cancel(ref, force=True)
        raise
    report = manifests["report"].summary if "report" in manifests else {}
    summary = run_summary(cfg.run.name, results, manifests, time.time() - started)
    return {
        "run": cfg.run.name,
        "stages": {n: results[n] for n in order if n in results},
        "report": report.get("report"),
        "private_report": report.get("private_report"),
        "summary": summary.format(),
    }


def _ready(
    name: str,
    order: list[str],
    done: dict[str, Any],
    running: dict[Any, tuple[str, str, float]] | None = None,
) -> bool:
    """Every stage that ``name`` reads and that is part of this run has finished.

    A ``late`` input (:attr:`Stage.late`) may still be running instead.
    """
    stage = STAGES[name]
    started = {n for n, _, _ in (running or {}).values()} & set(stage.late)
    return all(
        dep in done or dep in started
        for dep in (*stage.needs, *(a for a in stage.after if a in order))
    )


def _late_inputs(
    stage: type[Stage], running: dict[Any, tuple[str, str, float]]
) -> dict[str, PendingInput]:
    """The running ``late`` inputs of ``stage``: fingerprint and pending Ray result each."""
    return {
        name: PendingInput(fp, ref) for ref, (name, fp, _) in running.items() if name in stage.late
    }


def _fits(
    stage: type[Stage], cfg: PipelineConfig, running: dict[Any, tuple[str, str, float]]
) -> bool:
    """Whether ``stage``'s CPU and GPU footprints fit beside the running stages' on this cluster.

    Footprints count the workers a stage starts later (Ray Train's), so a
    stage launched beside others never waits on CPUs or GPUs they took first.
    A footprint larger than the cluster counts as the whole cluster (the stage
    starts once nothing else holds that resource).
    """
    import ray

    cluster = ray.cluster_resources()
    total = cluster.get("CPU", 1.0)
    used = 0.0
    for other, _, _ in running.values():
        fp = STAGES[other].footprint(cfg)
        used += total if fp is None else fp
    own = stage.footprint(cfg)
    if used + (total if own is None else own) > total + 1e-9:
        return False
    own_gpus = stage.gpu_footprint(cfg)
    if not own_gpus:
        return True
    gpus = cluster.get("GPU", 0.0)
    used_gpus = sum(min(gpus, STAGES[o].gpu_footprint(cfg)) for o, _, _ in running.values())
    return used_gpus + min(gpus, own_gpus) <= gpus + 1e-9


def _get(ref: Any) -> StageManifest:
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        # A user-facing error (bad config, bad row) reads as itself, not as a remote traceback.
        if isinstance(exc.cause, PrivcodeError):
            raise exc.cause from None
        raise


def _done(
    results: dict[str, dict[str, Any]], name: str, directory: Path, fp: str, t0: float
) -> None:
    results[name] = {
        "status": "ran",
        "dir": str(directory),
        "fingerprint": fp,
        "seconds": round(time.time() - t0, 2),
    }
    _say(f"[{name}] done in {time.time() - t0:.1f}s ({directory})")


def _with_dependencies(selected: list[str]) -> list[str]:
    """Selected stages plus everything they need, in a valid order."""
    order: list[str] = []

    def visit(name: str) -> None:
        for dep in STAGES[name].needs:
            visit(dep)
        for dep in STAGES[name].after:
            if dep in selected:
                visit(dep)
        if name not in order:
            order.append(name)

    for name in selected:
        visit(name)
    return order


def _say(message: str) -> None:
    # Stage names and paths only: never record content.
    print(f"privcode: {message}", flush=True)
