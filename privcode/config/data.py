"""The inputs: the private demo corpus (``data``) and the public base model (``base``)."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class DataConfig:
    """The private demo corpus: stdlib functions + HumanEval, with PII and canaries."""

    seed: int = opt(0, "Random seed: same seed, same bytes.")
    size: int = opt(
        1000,
        "Number of ordinary (non-canary) records, members and held-out "
        "together. At most the number of documented functions available.",
        min=10,
        max=100_000,
    )
    include_humaneval: bool = opt(
        True,
        "Add the 164 HumanEval problems (prompt, canonical "
        "solution) to the pool of ordinary records.",
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
        (5, 10, 100),
        "How many training records carry each canary (one canary per "
        "kind x placement x repetition count).",
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
