"""Stage II driver: stream the synthesis through Ray Data, shard by shard, resumably.

Input: the released Stage I artifact and public resources only (no private-data path in
:class:`~privcode.config.SynthConfig`; :func:`check_release_path` refuses anything but a
verified release), so everything here is post-processing of the DP release. A release that is
not DP is refused unless ``synth.allow_non_dp_release``; then every output says that NO DP
guarantee holds (:func:`release_privacy`). One streaming dataset of autoscaling actor pools
(:mod:`privcode.synth.resources`)::

    sample indices -> Generate -> Extract -> ExecutionFilter (sandbox) -> RoundTripScore -> driver

Shard ``k`` is written (temp, then rename) once all its rows arrived; a rerun skips the shards
on disk, and sample i's latent depends only on ``(seed, i)``. The work directory is keyed by
the release's hash and the generation settings. Finally duplicates are removed
(:class:`privcode.synth.dedup.Deduplicator`) and ``synthetic.parquet`` and ``stats.json``
written. Design notes: docs/methods.md, "synth/pipeline.py".
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

from privcode.artifacts.junior import ReleaseError, read_privacy, verify_release
from privcode.config import SandboxConfig, SynthConfig, section_to_dict
from privcode.errors import PrivcodeError
from privcode.sandbox import SandboxError
from privcode.sandbox.executor import preflight
from privcode.sandbox.pool import isolation_note

# The filter actors' resources (torch- and Ray-free, for the stage planner); FILTER_CPUS
# and the shares are re-exported here, where the stages import them.
from privcode.synth.dataflow import build_dataset as _dataset
from privcode.synth.resources import (  # noqa: F401
    EXECUTION_CPUS,
    EXTRACT_CPUS,
    FILTER_CPUS,
    ROUNDTRIP_CPUS,
    filter_actor_options,
    filter_batch_sizes,
    filter_footprint,
    filter_pools,
    llm_filters,
    llm_placement,
)
from privcode.synth.telemetry import POOLS_FILE, PoolTelemetry
from privcode.utils import atomic_path, atomic_write_json, sha256_bytes, sha256_file

log = logging.getLogger("privcode.synth")

__all__ = ["SynthesisError", "check_release_path", "release_privacy", "run_synthesis", "work_key"]

#: Settings that change what a shard holds (worker counts and limits of the
#: pools do not, except the sandbox limits, which change verdicts).
_SHARD_FIELDS = (
    "num_samples",
    "shard_size",
    "seed",
    "max_new_tokens",
    "temperature",
    "top_p",
    "start_text",
    "trim",
    "extractor",
    "extractor_model",
    "summarizer",
    "summarizer_model",
    "scorer",
    "scorer_model",
    "scorer_precision",
    "roundtrip_threshold",
    "sandbox_cpu_seconds",
    "sandbox_wall_seconds",
    "sandbox_memory_mb",
    "parse_check_languages",
)
_PRIVATE_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")
#: The filter operators' classes (what Ray Data names the operators) -> their pools.
_FILTER_UDFS = {"Extract": "extract", "ExecutionFilter": "execution", "RoundTripScore": "roundtrip"}


class SynthesisError(PrivcodeError):
    """Stage II cannot run (a non-release input, lost rows, a failed operator)."""


def check_release_path(path: str | Path) -> dict[str, Any]:
    """``release.json`` of a verified release; refuses anything else, private data above all."""

    p = Path(path)
    if p.is_file() and p.suffix.lower() in _PRIVATE_SUFFIXES:
        raise SynthesisError(
            f"{p}: Stage II reads only the released DP artifact (a release "
            "directory), never a dataset file; refusing to start"
        )
    if (p / "manifest.json").is_file() and (p / "train.parquet").exists():
        raise SynthesisError(
            f"{p}: this is a private corpus directory; Stage II reads only "
            "the released DP artifact; refusing to start"
        )
    try:
        return verify_release(p)
    except ReleaseError as exc:
        raise SynthesisError(
            f"not a released Stage I artifact ({exc}); run the train stage "
            "(`privcode train`) or set synth.release"
        ) from None


def release_privacy(
    release: str | Path, meta: dict[str, Any], *, allow_non_dp: bool = False
) -> dict[str, Any]:
    """The privacy standing of a verified release: ``{"dp", "epsilon", "delta", "privacy_warning"}``.

    Fails closed: only ``dp`` exactly true in ``release.json`` counts as DP
    (a missing key does not). A non-DP release raises SynthesisError unless
    ``allow_non_dp`` (``synth.allow_non_dp_release``); then it is logged
    loudly and ``privacy_warning`` says, in plain words, that no DP
    guarantee holds. For a DP release, epsilon and delta come from its
    ``privacy.json`` (whose hash :func:`check_release_path` has verified).
    """
    release = Path(release)
    if meta.get("dp") is not True:
        what = f"dp: {json.dumps(meta['dp'])}" if "dp" in meta else "no 'dp' key in release.json"
        if not allow_non_dp:
            raise SynthesisError(
                f"{release}: the release (method {meta.get('method')!r}) is NOT differentially "
                f"private ({what}); Stage II refuses to synthesise from it, since its synthetic "
                "data would carry no DP guarantee. Set synth.allow_non_dp_release=true to run "
                "anyway (UNSAFE: every artifact then says that no DP guarantee holds)"
            )
        warning = (
            f"NO differential-privacy guarantee: synthesised from a non-DP release "
            f"({release}, method {meta.get('method')!r}, {what}) because "
            "synth.allow_non_dp_release is set; this data and anything trained on it "
            "are NOT PRIVATE"
        )
        log.error("Stage II input %s is NOT PRIVATE: %s", release, warning)
        warnings.warn(warning, RuntimeWarning, stacklevel=3)
        return {"dp": False, "epsilon": None, "delta": None, "privacy_warning": warning}

    try:
        privacy = read_privacy(release)
    except ReleaseError as exc:
        raise SynthesisError(str(exc)) from None
    if not privacy.dp:
        raise SynthesisError(
            f"{release / privacy.FILE}: does not say dp: true although "
            "release.json does; refusing to start"
        )
    return {
        "dp": True,
        "epsilon": privacy.epsilon,
        "delta": privacy.delta,
        "privacy_warning": None,
    }


def _provenance(release_sha: str, meta: dict[str, Any], privacy: dict[str, Any]) -> str:
    """The provenance JSON of every synthetic row (what the premium fine-tune checks)."""
    prov: dict[str, Any] = {
        "release_sha256": release_sha,
        "method": meta["method"],
        "conditioning": meta["conditioning"],
        "dp": privacy["dp"],
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
    }
    if not privacy["dp"]:
        prov.update(no_dp_guarantee=True, NOT_PRIVATE=privacy["privacy_warning"])
    return json.dumps(prov, sort_keys=True)


def work_key(cfg: SynthConfig, release_meta: dict[str, Any]) -> str:
    """Names the shard directory: the release's file hashes plus the shard-defining settings."""
    settings = {k: getattr(cfg, k) for k in _SHARD_FIELDS}
    if cfg.dtype != "auto":  # a requested dtype changes the samples (auto: keys as before)
        settings["dtype"] = cfg.dtype
    if cfg.llm_max_new_tokens != 96:  # the LLM filters' answer length (96: keys as before)
        settings["llm_max_new_tokens"] = cfg.llm_max_new_tokens
    blob = json.dumps(
        {"release": release_meta.get("files"), "settings": settings}, sort_keys=True
    ).encode()
    return sha256_bytes(blob)[:16]


def _shard_path(work: Path, k: int) -> Path:
    return work / "shards" / f"shard-{k:05d}.parquet"


def _write_shard(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(rows, key=lambda r: r["index"])
    table = pa.Table.from_pylist(rows)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _row(batch: dict[str, Any], j: int) -> dict[str, Any]:
    out = {}
    for key, col in batch.items():
        v = col[j]
        out[key] = v.item() if hasattr(v, "item") else v
    return out


def _generate_shards(
    cfg: SynthConfig,
    release: Path,
    work: Path,
    conditioning: str,
    progress: bool,
    generator: type | None = None,
    sandbox: SandboxConfig | None = None,
) -> tuple[dict[str, int], PoolTelemetry | None]:
    """Generate the shards not yet on disk; the counts, and the pools' telemetry (None when
    every shard was resumed)."""
    n, size = cfg.num_samples, cfg.shard_size
    shards = range((n + size - 1) // size)
    pending = [k for k in shards if not _shard_path(work, k).is_file()]
    counts = {
        "shards": len(shards),
        "shards_resumed": len(shards) - len(pending),
        "shards_written": 0,
        "generated_this_run": 0,
    }
    if not pending:
        return counts, None
    indices = [i for k in pending for i in range(k * size, min((k + 1) * size, n))]
    counts["generated_this_run"] = len(indices)
    expected = {k: min((k + 1) * size, n) - k * size for k in pending}
    buffers: dict[int, list[dict[str, Any]]] = defaultdict(list)
    cpus = {k: v["num_cpus"] for k, v in filter_actor_options(cfg).items()}
    telemetry = PoolTelemetry(
        {(generator or _default_generator()).__name__: "generate", **_FILTER_UDFS},
        {"generate": cfg.cpus_per_generator, **cpus},
    )
    ds = _dataset(cfg, release, indices, conditioning, generator, sandbox)
    with telemetry:
        _consume(ds, cfg, work, len(shards), expected, buffers, counts, progress)
    if buffers:
        missing = sorted(buffers)
        raise SynthesisError(
            f"Stage II lost rows: shards {missing[:5]} incomplete after the "
            "dataset finished; rerun to regenerate them"
        )
    return counts, telemetry


def _default_generator() -> type:
    from privcode.synth.operators import Generate

    return Generate


def _consume(
    ds: Any,
    cfg: SynthConfig,
    work: Path,
    n_shards: int,
    expected: dict[int, int],
    buffers: dict[int, list[dict[str, Any]]],
    counts: dict[str, int],
    progress: bool,
) -> None:
    """Write each shard as its last row arrives from ``ds``."""
    size = cfg.shard_size
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for j in range(len(batch["index"])):
            row = _row(batch, j)
            k = int(row["index"]) // size
            buffers[k].append(row)
            if len(buffers[k]) == expected[k]:
                rows = buffers.pop(k)
                _write_shard(_shard_path(work, k), rows)
                counts["shards_written"] += 1
                if counts["shards_written"] == 1:
                    _check_runnable(rows, cfg.min_runnable_fraction)
                if progress:
                    log.info(
                        "synth: shard %d written (%d/%d)",
                        k,
                        counts["shards_written"] + counts["shards_resumed"],
                        n_shards,
                    )


def _check_runnable(rows: list[dict[str, Any]], minimum: float) -> None:
    """Fail fast (after the first shard) when the junior writes almost no runnable code."""
    runnable = sum(bool(r["exec_passed"]) for r in rows)
    if not rows or runnable >= minimum * len(rows):
        return
    statuses: dict[str, int] = defaultdict(int)
    for r in rows:
        statuses[r["exec_status"]] += 1
    raise SynthesisError(
        f"synth: only {runnable} of the first {len(rows)} samples run (execution statuses: "
        + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
        + f"; synth.min_runnable_fraction={minimum}). The DP junior writes almost no runnable "
        "Python: look at the base stage (base.json: is the base complete, its held-out loss?) "
        "and the train stage (its epsilon, steps and public held-out loss curve), or at the "
        "sampling settings (synth.temperature, synth.start_text, synth.max_new_tokens). "
        "Set synth.min_runnable_fraction=0 to synthesise anyway."
    )


def _finalize_shard(
    path: Path,
    cfg: SynthConfig,
    dedup: Any,
    provenance: str,
    funnel: dict[str, int],
    statuses: dict[str, int],
    levels: dict[str, int],
) -> list[dict[str, Any]]:
    """Count one shard into the funnel; its kept rows (passed both filters, not a duplicate)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    funnel["generated"] += len(rows)
    survivors = []
    for r in rows:
        statuses[r["exec_status"]] += 1
        levels[r.get("exec_isolation") or "unrecorded"] += 1
        if not r["exec_passed"]:
            funnel["removed_execution"] += 1
        elif not r["roundtrip_passed"]:
            funnel["removed_roundtrip"] += 1
        else:
            survivors.append(r)
    ids = [f"syn-{cfg.seed}-{r['index']:08d}" for r in survivors]
    dup_of = dedup.add(ids, [r["code"] for r in survivors]) if survivors else []
    kept = []
    for rid, r, dup in zip(ids, survivors, dup_of, strict=True):
        if dup is not None:
            funnel["removed_duplicate"] += 1
            continue
        kept.append(
            {
                "id": rid,
                "prompt": r["prompt"],
                "code": r["code"],
                "z_seed": r["z_seed"],
                "exec_status": r["exec_status"],
                "exec_seconds": r["exec_seconds"],
                "roundtrip_score": r["roundtrip_score"],
                "duplicate_of": None,
                "provenance": provenance,
            }
        )
    funnel["kept"] += len(kept)
    return kept


def _finalize(
    cfg: SynthConfig,
    work: Path,
    out_dir: Path,
    release_meta: dict[str, Any],
    release_sha: str,
    privacy: dict[str, Any],
) -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from privcode.synth.dedup import Deduplicator

    dedup = Deduplicator(threshold=cfg.dedup_threshold)
    provenance = _provenance(release_sha, release_meta, privacy)
    funnel = {
        "generated": 0,
        "removed_execution": 0,
        "removed_roundtrip": 0,
        "removed_duplicate": 0,
        "kept": 0,
    }
    statuses: dict[str, int] = defaultdict(int)
    levels: dict[str, int] = defaultdict(int)
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("prompt", pa.string()),
            ("code", pa.string()),
            ("z_seed", pa.string()),
            ("exec_status", pa.string()),
            ("exec_seconds", pa.float64()),
            ("roundtrip_score", pa.float64()),
            ("duplicate_of", pa.string()),
            ("provenance", pa.string()),
        ]
    )
    n_shards = (cfg.num_samples + cfg.shard_size - 1) // cfg.shard_size
    with atomic_path(out_dir / "synthetic.parquet") as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for k in range(n_shards):
            kept = _finalize_shard(
                _shard_path(work, k), cfg, dedup, provenance, funnel, statuses, levels
            )
            if kept:  # one row group per shard: memory stays flat at any num_samples
                writer.write_table(pa.Table.from_pylist(kept, schema=schema))
    if sum(v for k, v in funnel.items() if k != "generated") != funnel["generated"]:
        raise SynthesisError(f"filter counts do not add up: {funnel}")

    g = max(funnel["generated"], 1)
    stats = {
        "dp": privacy["dp"],
        "privacy_warning": privacy["privacy_warning"],
        "funnel": funnel,
        "rates": {k: round(v / g, 4) for k, v in funnel.items() if k != "generated"},
        "execution_statuses": dict(sorted(statuses.items())),
        "sandbox": _sandbox_stats(levels),
        "release": {
            "sha256": release_sha,
            "method": release_meta["method"],
            "conditioning": release_meta["conditioning"],
            "dp": privacy["dp"],
            "epsilon": privacy["epsilon"],
            "delta": privacy["delta"],
        },
        "config": section_to_dict(cfg),
    }
    atomic_write_json(out_dir / "stats.json", stats)
    return stats


def _sandbox_stats(levels: dict[str, int]) -> dict[str, Any]:
    """The isolation levels the verdicts ran under (snippet counts) and what they mean."""

    notes = sorted(  # "parse-check": not executed (synth.parse_check_languages)
        {n for lv in levels if lv != "parse-check" and (n := isolation_note(lv)) is not None}
    )
    return {"isolation": dict(sorted(levels.items())), "notes": notes}


def run_synthesis(
    cfg: SynthConfig,
    *,
    release: str | Path,
    out_dir: str | Path,
    work_root: str | Path,
    progress: bool = True,
    generator: type | None = None,
    sandbox: SandboxConfig | None = None,
) -> dict[str, Any]:
    """Synthesise from ``release`` into ``out_dir`` (see the module docstring); returns a summary.

    ``generator`` replaces :class:`~privcode.synth.operators.Generate` (same
    constructor and batch contract), e.g. a cheap stand-in for benchmarks.  ``sandbox``:
    the isolation required and the executor; a sandbox that cannot give it stops the
    stage before anything runs.
    """

    sandbox = sandbox or SandboxConfig()
    if cfg.generators_max < cfg.generators_min:
        raise SynthesisError(
            f"synth.generators_max={cfg.generators_max} is below "
            f"generators_min={cfg.generators_min}"
        )
    release = Path(release).resolve()
    meta = check_release_path(release)
    privacy = release_privacy(release, meta, allow_non_dp=cfg.allow_non_dp_release)
    try:
        preflight(sandbox.isolation, sandbox.executor)
    except SandboxError as exc:
        raise SynthesisError(f"synth: the execution filter cannot run: {exc}") from None
    work = Path(work_root).resolve() / work_key(cfg, meta)
    (work / "shards").mkdir(parents=True, exist_ok=True)
    _clear_stale_temporaries(work)
    summary = _synthesise(cfg, release, meta, privacy, work, out_dir, progress, generator, sandbox)
    _clear_stale_temporaries(work)
    return summary


def _clear_stale_temporaries(work: Path) -> int:
    """Remove ``shards/.*.tmp``: half-written shards of a killed run. Returns how many.

    Called before generating and again after finishing: this run's own
    temporaries are renamed into place as each shard completes, so what is
    left is stale (a killed run's stage task may outlive its driver for a
    while and leave one more).
    """
    stale = list((work / "shards").glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def _synthesise(
    cfg: SynthConfig,
    release: Path,
    meta: dict[str, Any],
    privacy: dict[str, Any],
    work: Path,
    out_dir: str | Path,
    progress: bool,
    generator: type | None,
    sandbox: SandboxConfig,
) -> dict[str, Any]:
    import ray

    from privcode.cluster.local import connect

    release_sha = sha256_bytes(json.dumps(meta.get("files"), sort_keys=True).encode())
    atomic_write_json(
        work / "settings.json", {"release": str(release), "config": section_to_dict(cfg)}
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        connect()
    started = time.time()
    counts, telemetry = _generate_shards(
        cfg, release, work, meta["conditioning"], progress, generator, sandbox
    )
    operators = {}
    if telemetry is not None:  # this run generated: the pools' timeline and throughput
        generating = time.time() - started
        operators = telemetry.summary(generating)
        atomic_write_json(
            out_dir / POOLS_FILE,
            {"seconds": round(generating, 2), "operators": operators, **telemetry.timeline()},
        )
    stats = _finalize(cfg, work, out_dir, meta, release_sha, privacy)
    seconds = round(time.time() - started, 2)
    return {
        **stats["funnel"],
        **counts,
        "operators": operators,
        "rates": stats["rates"],
        "execution_statuses": stats["execution_statuses"],
        "sandbox": stats["sandbox"],
        "seconds": seconds,
        # Over the samples generated by this run (resumed shards cost nothing).
        "samples_per_second": (
            round(counts["generated_this_run"] / max(seconds, 1e-9), 2)
            if counts["generated_this_run"]
            else None
        ),
        "release": str(release),
        "release_sha256": release_sha,
        "synthetic_sha256": sha256_file(out_dir / "synthetic.parquet"),
        "work_dir": str(work),
        "conditioning": meta["conditioning"],
        "method": meta["method"],
        "dp": privacy["dp"],
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "privacy_warning": privacy["privacy_warning"],
    }
