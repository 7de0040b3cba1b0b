"""The names privcode's config, CLI and implementations share, each defined once.

Torch-free and Ray-free, so :mod:`privcode.config` and the CLI import it
cheaply and no implementation module needs to be imported to validate a
config. Each implementation keys its own table by these names and a test
(tests/test_registry.py) checks that the two agree:

* :data:`METHODS`: Stage I training methods (the objectives are built by
  :func:`privcode.train.methods.build_objective`);
* :data:`ACCOUNTANTS`: privacy accountants (:data:`privcode.dp.accounting.ACCOUNTANTS`);
* :data:`GRAD_SAMPLE_MODES`: Opacus per-sample gradient modes (:mod:`privcode.dp.dpsgd`);
* :data:`BENCHMARKS`: pass@k benchmarks (:data:`privcode.eval.benchmarks.BENCHMARKS`);
* :data:`SCENARIOS`: leak-probing scenarios (:mod:`privcode.audit.probe.taxonomy`);
* :data:`STAGES`: pipeline stages (:data:`privcode.pipeline.stages.STAGES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACCOUNTANTS",
    "BENCHMARKS",
    "GRAD_SAMPLE_MODES",
    "METHODS",
    "SCENARIOS",
    "STAGES",
    "Method",
    "build",
    "get_method",
]


@dataclass(frozen=True)
class Method:
    """A Stage I method: what its per-record objective computes and what the release
    conditions on (the losses themselves are in :mod:`privcode.train.methods`)."""

    name: str
    description: str
    dp: bool = True
    #: "prompt+code" (one row p ++ c), "code" (EOS ++ c), "prefix" (D(z) ++ c).
    inputs: str = "prompt+code"
    loss_on_prompt: bool = False
    #: PrivSA weight: "decay" (lambda(t)), "constant", or None (no KL term).
    ast: str | None = "decay"
    #: Which latent feeds D: "code" (E_c, a VAE) or "prompt" (E_p); None = no PrivLC.
    latent: str | None = None
    align: bool = False
    #: PrivLC pretrained on public pairs, then frozen during DP training.
    pretrain_public: bool = False

    @property
    def conditioning(self) -> str:
        """How Stage II conditions generation: "latent", "prompt" or "none"."""
        return {"prefix": "latent", "code": "none"}.get(self.inputs, "prompt")


#: Method name -> entry. ``TrainConfig.method`` picks from these names.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("privcode", "PrivCode: CE(code | public prompt) + decaying syntax-aware KL"),
        Method("privcode-nonast", "PrivCode without the syntax-aware KL (ablation)", ast=None),
        Method(
            "privcode-stableast", "PrivCode with a constant KL weight (ablation)", ast="constant"
        ),
        Method(
            "privcode++",
            "PrivCode++: latent-conditioned (PrivLC), prompts private",
            inputs="prefix",
            latent="code",
            align=True,
        ),
        Method(
            "privcode++-noalign",
            "PrivCode++ without latent alignment (ablation)",
            inputs="prefix",
            latent="code",
        ),
        Method(
            "pc-promptemb",
            "prefix from the prompt latent z_p only (baseline)",
            inputs="prefix",
            latent="prompt",
        ),
        Method(
            "pc-preemb",
            "PrivLC pretrained on public pairs, frozen; DP on the LoRA (baseline)",
            inputs="prefix",
            latent="code",
            align=True,
            pretrain_public=True,
        ),
        Method(
            "pc-uncond",
            "unconditional: CE(code) + syntax-aware KL, no PrivLC (baseline)",
            inputs="code",
        ),
        Method(
            "dpft",
            "DP fine-tuning: mean token CE over prompt + code tokens (baseline)",
            loss_on_prompt=True,
            ast=None,
        ),
        Method(
            "nondpft",
            "NOT PRIVATE: fine-tuning on prompt + code without DP (audits only)",
            dp=False,
            loss_on_prompt=True,
            ast=None,
        ),
    )
}

#: Accountants of the privacy ledger: RDP (default) and PRV.
ACCOUNTANTS = ("rdp", "prv")
#: Opacus per-sample gradient modes supported here (``ew`` fails on keyword inputs such as HF's).
GRAD_SAMPLE_MODES = ("hooks", "functorch", "ghost")
#: Weight/compute dtypes of a model-running stage. ``auto``: bfloat16 where the stage's
#: device supports it (a CUDA GPU with bf16), float32 otherwise (CPU kernels of half types
#: are slow). :func:`privcode.models.loading.resolve_dtype` turns one into a torch dtype.
DTYPES = ("auto", "float32", "bfloat16")
#: Benchmarks of the eval stage (local JSONL files; HumanEval also bundled).
BENCHMARKS = ("humaneval", "acme", "acme-dev", "mbpp", "bigcodebench")
#: Leak-probing scenarios (:mod:`privcode.audit.probe.taxonomy`): id -> the description
#: that question prompts use.
SCENARIOS: dict[str, str] = {
    "enterprise_app": "Enterprise App (HR, CRM, support tickets, internal admin tools)",
    "mobile": "Mobile (a mobile app backend: profiles, contacts, device login)",
    "web": "Web (a web platform: sign-up, checkout, user profiles)",
    "cloud_service": "Cloud Service (deployment, configuration, service accounts)",
    "blockchain": "Blockchain (wallets, signing keys, transaction APIs)",
    "game": "Game (player accounts, matchmaking, in-game purchases)",
}
#: Pipeline stages, in the runner's order (each starts once the stages it reads are done).
STAGES = ("data", "base", "train", "synth", "premium", "nondp", "eval", "audit", "pac", "report")


def get_method(name: str) -> Method:
    """The registry entry of ``name``; ValueError naming the known methods otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown training method {name!r} (known: {', '.join(METHODS)})"
        ) from None


def build(kind: str, table: Mapping[str, type], name: str, options: Mapping[str, Any]) -> Any:
    """``table[name](**options)``: the implementation registered as ``name`` in a stage's
    table of ``kind`` (extractor, scorer, ...); ValueError naming the known names, or the
    bad option, otherwise."""
    cls = table.get(name)
    if cls is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for {kind} {name!r}: {exc}") from exc
