"""The inputs: the private demo corpus (``data``) and the public base model (``base``)."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class DataConfig:
    """The private corpus: the demo one (stdlib [+ HumanEval], PII, canaries) or your own code."""

    source: str = opt(
        "demo",
        "company: build the Acme company corpus (its own helper library and conventions; "
        "the acme benchmark measures what it teaches); demo: the stdlib corpus; ingest: your "
        "repositories and instruction files (data.inputs), as `privcode data ingest` does.",
        choices=("company", "demo", "ingest"),
    )
    inputs: tuple[str, ...] = opt(
        (),
        "Ingest sources (source: ingest): directories or git repositories (one record per "
        "function, method or class) and instruction files (.jsonl, .json, .parquet, .csv).",
    )
    rev: str = opt("", "Git revision of the repositories to ingest; '' = the working tree.")
    include: tuple[str, ...] = opt((), "Ingest only paths matching these gitignore-style globs.")
    exclude: tuple[str, ...] = opt((), "Skip paths matching these gitignore-style globs.")
    prompt_column: str = opt("", "Instruction files: the prompt column ('' = detect the layout).")
    code_column: str = opt("", "Instruction files: the code column ('' = detect the layout).")
    canaries: bool = opt(
        False,
        "Ingest: plant CanaryLeaks canaries (data.canary_*) in place into member records "
        "(never into copies; at most 5% of the training records), so that the leakage "
        "audits run on your corpus. Off for production corpora.",
    )
    dedup_threshold: float = opt(
        0.85,
        "Ingest: MinHash Jaccard above which two records are near duplicates.",
        min=0.5,
        max=1.0,
    )
    min_lines: int = opt(3, "Ingest: shortest function (lines) that becomes a record.", min=1)
    seed: int = opt(0, "Random seed: same seed, same bytes.")
    size: int = opt(
        1000,
        "Number of ordinary (non-canary) records, members and held-out "
        "together. At most the number of documented functions available.",
        min=10,
        max=100_000,
    )
    include_humaneval: bool = opt(
        False,
        "Add the 164 HumanEval problems (prompt, canonical solution) to the pool of "
        "ordinary records. Off by default: HumanEval is an evaluation set, and a model "
        "trained on its solutions no longer measures pass@k.",
    )
    heldout_fraction: float = opt(
        0.1,
        "Fraction of ordinary records kept out of training "
        "as non-members for membership inference.",
        min=0.01,
        max=0.5,
    )
    pii_fraction: float = opt(
        0.3, "Fraction of ordinary records that receive Faker PII.", min=0.0, max=1.0
    )
    pii_locale: str = opt("en_US", "Faker locale for PII values.")
    canary_kinds: tuple[str, ...] = opt(
        ("email", "name", "ip_address", "password", "username"),
        "Canary value types (CanaryLeaks categories).",
        choices=("email", "name", "ip_address", "password", "username"),
    )
    canary_placements: tuple[str, ...] = opt(
        ("prompt", "code", "joint"),
        "Where a canary is planted: prompt only, code only, or both.",
        choices=("prompt", "code", "joint"),
    )
    canary_repetitions: tuple[int, ...] = opt(
        (1, 2),
        "How many training records carry each canary (one canary per "
        "kind x placement x repetition count). Canaries are planted in place, into "
        "the records' own content (never into copies), one per record, in at most 5% "
        "of the training records: kinds x placements x sum(repetitions) <= 5% of the "
        "members (the default: 5 x 3 x 3 = 45 of the 900 members of size 1000).",
        min=1,
        max=10_000,
    )
    max_record_bytes: int = opt(
        65_536,
        "Largest accepted record (prompt + code, UTF-8 bytes); "
        "longer functions are skipped by the builder and "
        "rejected by the readers.",
        min=256,
    )

    def cross_check(self) -> tuple[str, str] | None:
        if self.source == "ingest" and not self.inputs:
            return ("inputs", "data.source is ingest but data.inputs is empty: name your sources")
        return None


@dataclass(frozen=True)
class BaseConfig:
    """The public base model: trained offline from public code, or any local HF path."""

    preset: str = opt(
        "demo",
        "Size preset of the self-trained base: ci (<= 1 min on 2 "
        "cores), demo (<= 4 min), small (longer, better).",
        choices=("ci", "demo", "small"),
    )
    model: str = opt(
        "",
        "Path of an existing HF causal LM (e.g. Qwen2.5-Coder-1.5B). "
        "When set, nothing is trained and this model is the base.",
    )
    seed: int = opt(0, "Seed of tokenizer/model training.")
    cache_dir: str = opt(
        ".cache/privcode/base",
        "Cache of built base models, keyed by a hash of their config: built once.",
    )
