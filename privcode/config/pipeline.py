"""All sections of one config file: :data:`SECTIONS` and :class:`PipelineConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from privcode.config.audit import AuditConfig
from privcode.config.data import BaseConfig, DataConfig
from privcode.config.eval import EvalConfig
from privcode.config.fields import section_to_dict
from privcode.config.pac import PacConfig
from privcode.config.premium import PremiumConfig
from privcode.config.privacy import PrivacyConfig, ReportConfig
from privcode.config.run import RunConfig
from privcode.config.sandbox import SandboxConfig
from privcode.config.serve import ServeConfig
from privcode.config.synth import SynthConfig
from privcode.config.train import TrainConfig

#: Section name -> dataclass. Later stages add their section here.
SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "data": DataConfig,
    "base": BaseConfig,
    "train": TrainConfig,
    "synth": SynthConfig,
    "premium": PremiumConfig,
    "eval": EvalConfig,
    "audit": AuditConfig,
    "pac": PacConfig,
    "sandbox": SandboxConfig,
    "serve": ServeConfig,
    "privacy": PrivacyConfig,
    "report": ReportConfig,
}


@dataclass(frozen=True)
class PipelineConfig:
    """All sections of one config file."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    premium: PremiumConfig = field(default_factory=PremiumConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    pac: PacConfig = field(default_factory=PacConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    source: str = field(
        default="<defaults>", compare=False, metadata={"help": "File the config was loaded from."}
    )

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def to_dict(self) -> dict[str, Any]:
        return {name: section_to_dict(getattr(self, name)) for name in SECTIONS}
