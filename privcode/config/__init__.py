"""Configuration: one frozen dataclass per stage, loaded from YAML and validated.

A pipeline config file has one mapping per section::

    run:   {name: demo, stages: [data, base, report]}
    data:  {seed: 0, size: 600}
    base:  {preset: demo}

Every field carries its help text and its constraints in ``dataclasses.field``
metadata (``help``, and optionally ``min``, ``max``, ``choices``,
``min_len``). :func:`load_config` rejects an unknown section or key, a value of
the wrong type, and an out-of-range value with a :class:`ConfigError` naming
the file and the dotted key. Command-line overrides (``--set data.size=100``)
are parsed as YAML scalars and validated the same way.

New stages register their section in :data:`SECTIONS` (:mod:`~privcode.config.pipeline`); nothing
else changes.

One module per section (``run``, ``data`` with ``base``, ``train``, ``synth``,
``premium``, ``eval``, ``audit``, ``pac``, ``sandbox``, ``serve``, ``privacy`` with ``report``),
:mod:`~privcode.config.fields` (``opt`` and the constraint check),
:mod:`~privcode.config.pipeline` (``SECTIONS``, ``PipelineConfig``) and
:mod:`~privcode.config.loader`; every name is imported from here.
"""

from privcode.config.audit import AuditConfig
from privcode.config.data import BaseConfig, DataConfig
from privcode.config.eval import EvalConfig
from privcode.config.fields import opt, section_to_dict
from privcode.config.loader import build_section, describe, load_config, parse_override
from privcode.config.pac import PacConfig
from privcode.config.pipeline import SECTIONS, PipelineConfig
from privcode.config.premium import PremiumConfig
from privcode.config.privacy import PrivacyConfig, ReportConfig
from privcode.config.run import RunConfig
from privcode.config.sandbox import SandboxConfig
from privcode.config.serve import ServeConfig
from privcode.config.synth import SynthConfig
from privcode.config.train import TrainConfig
from privcode.errors import ConfigError

__all__ = [
    "ConfigError",
    "PipelineConfig",
    "SECTIONS",
    "load_config",
    "describe",
    "RunConfig",
    "DataConfig",
    "BaseConfig",
    "TrainConfig",
    "SynthConfig",
    "PremiumConfig",
    "EvalConfig",
    "AuditConfig",
    "PacConfig",
    "PrivacyConfig",
    "SandboxConfig",
    "ServeConfig",
    "ReportConfig",
    "build_section",
    "opt",
    "parse_override",
    "section_to_dict",
]
