"""``privcode data ingest SOURCE... --out DIR``: your repositories and instruction data as
the private corpus (:func:`privcode.data.ingest.corpus.build_ingested_corpus`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from privcode.config import DataConfig, PrivacyConfig, load_config
from privcode.privacy.store import open_pinned


def spec_from_config(cfg: DataConfig, inputs: tuple[str, ...] | None = None):
    """The :class:`IngestSpec` of a ``data`` section (``inputs`` overrides data.inputs)."""
    from privcode.data.ingest.corpus import IngestSpec

    return IngestSpec(
        inputs=tuple(inputs if inputs is not None else cfg.inputs),
        rev=cfg.rev or None,
        include=cfg.include,
        exclude=cfg.exclude,
        prompt_column=cfg.prompt_column or None,
        code_column=cfg.code_column or None,
        heldout_fraction=cfg.heldout_fraction,
        dedup_threshold=cfg.dedup_threshold,
        max_record_bytes=cfg.max_record_bytes,
        min_lines=cfg.min_lines,
        canaries=cfg.canaries,
        canary_kinds=cfg.canary_kinds,
        canary_placements=cfg.canary_placements,
        canary_repetitions=cfg.canary_repetitions,
        locale=cfg.pii_locale,
    )


def split_key(privacy: PrivacyConfig) -> tuple[bytes, str]:
    """The secret that keys the held-out split (the privacy store's, never a public seed)
    and that store's id, which the corpus's manifest records."""

    store = open_pinned(privacy.store, privacy.store_id)
    return store.opaque("ingest-split", "1").encode(), store.store_id


def cmd_data_ingest(args: argparse.Namespace) -> int:

    from privcode.data.ingest.corpus import build_ingested_corpus, secret_rng

    cfg = load_config(args.config, list(args.overrides))
    data = replace(
        cfg.data,
        rev=args.rev or cfg.data.rev,
        include=tuple(args.include) or cfg.data.include,
        exclude=tuple(args.exclude) or cfg.data.exclude,
        prompt_column=args.prompt_column or cfg.data.prompt_column,
        code_column=args.code_column or cfg.data.code_column,
        canaries=args.canaries or cfg.data.canaries,
    )
    spec = spec_from_config(data, tuple(args.sources))
    key, store_id = split_key(cfg.privacy)
    manifest = build_ingested_corpus(
        spec, Path(args.out), split_key=key, rng=secret_rng(key), store_id=store_id
    )
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
    else:
        counts = manifest["counts"]
        print(f"wrote {args.out}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        for label, s in manifest["sources"].items():
            skipped = sum((s.get("files_skipped") or {}).values())
            print(
                f"  {label}: {s.get('units', s.get('rows'))} records"
                + (f" from {s['files']} files ({skipped} skipped)" if "files" in s else "")
                + f", languages {s['languages']}"
            )
        print(
            f"  scan: {json.dumps(manifest['scan'].get('totals', {}), sort_keys=True)} "
            "(counts only; scan.json per source)"
        )
    return 0


def add_ingest_parser(dsub, add_config_args) -> argparse.ArgumentParser:
    """Add ``ingest`` to the ``privcode data`` actions."""
    d = dsub.add_parser(
        "ingest",
        help="Your repositories (one record per function/method/class) and instruction "
        "files (JSONL/Parquet/CSV) as the private corpus.",
    )
    d.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="A directory or git repository, or an instruction file.",
    )
    d.add_argument("--out", required=True, help="Output directory (the corpus files).")
    d.add_argument("--rev", help="Git revision of the repositories (default: the working tree).")
    d.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="Only paths matching this gitignore-style glob (repeatable).",
    )
    d.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="Skip paths matching this glob (repeatable).",
    )
    d.add_argument("--prompt-column", help="Instruction files: the prompt column.")
    d.add_argument("--code-column", help="Instruction files: the code column.")
    d.add_argument(
        "--canaries",
        action="store_true",
        help="Plant CanaryLeaks canaries in place into member records, never into copies "
        "(at most 5%% of the training records; for audits).",
    )
    d.add_argument("--json", action="store_true", help="Print the manifest as JSON.")
    add_config_args(d, default=None)
    d.set_defaults(func=cmd_data_ingest)
    return d
