"""The PrivCodeRun and PrivacyBudget resources as the controller reads them.

``privcode.dev/v1alpha1``; the CRDs with their OpenAPI schemas are in
``charts/privcode/crds/``. The API server validates shapes; :func:`parse_run`
checks what a schema cannot (a path that stays inside its volume) and turns
the spec into a typed :class:`RunSpec`, naming the field that is wrong.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from privcode.errors import PrivcodeError

__all__ = [
    "BUDGET_PLURAL",
    "GROUP",
    "RAISE_PLURAL",
    "RUN_PLURAL",
    "VERSION",
    "RunSpec",
    "SpecError",
    "parse_run",
]

GROUP, VERSION = "privcode.dev", "v1alpha1"
RUN_PLURAL, BUDGET_PLURAL, RAISE_PLURAL = "privcoderuns", "privacybudgets", "privacybudgetraises"
_STAGE = re.compile(r"^[a-z]+$")
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class SpecError(PrivcodeError):
    """A PrivCodeRun whose spec cannot run (the message names the field)."""


@dataclass(frozen=True)
class RunSpec:
    """What one PrivCodeRun asks for."""

    config: str  #: the pipeline config (YAML text)
    data_claim: str  #: the PersistentVolumeClaim holding the training records
    data_path: str  #: the training file, relative to that claim
    epsilon: float  #: the run's own epsilon (train.epsilon): at most this is spent
    delta: float | None  #: train.delta; None: the config's
    stages: tuple[str, ...]  #: run.stages; () = the config's
    overrides: tuple[str, ...]  #: more ``--set`` overrides, key=value
    queue_name: str = ""  #: a Kueue LocalQueue: the RayJob is created suspended for Kueue

    def data_file(self, mount_root: str) -> str:
        """The training file where the claim is mounted under ``mount_root``."""
        return posixpath.join(mount_root, self.data_claim, self.data_path)


def _field(spec: Mapping[str, Any], path: str) -> Any:
    value: Any = spec
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def parse_run(spec: Mapping[str, Any], config_maps: Mapping[str, Mapping[str, str]]) -> RunSpec:
    """A :class:`RunSpec` from ``spec`` (``config_maps``: name -> data, for
    ``config.configMapRef``); :class:`SpecError` naming the field otherwise."""
    inline, ref = _field(spec, "config.inline"), _field(spec, "config.configMapRef")
    if bool(inline) == bool(ref):
        raise SpecError("spec.config: give exactly one of inline or configMapRef")
    if ref:
        name, key = str(ref.get("name", "")), str(ref.get("key", "pipeline.yaml"))
        text = (config_maps.get(name) or {}).get(key)
        if text is None:
            raise SpecError(f"spec.config.configMapRef: no key {key!r} in ConfigMap {name!r}")
    else:
        text = str(inline)
    claim, path = _field(spec, "data.claimName"), _field(spec, "data.path")
    if not isinstance(claim, str) or not _DNS1123.match(claim) or ".." in claim:
        raise SpecError("spec.data.claimName: the name of the claim holding the records")
    if not isinstance(path, str) or not path or path.startswith("/"):
        raise SpecError("spec.data.path: a path relative to the claim")
    if ".." in posixpath.normpath(path).split("/"):
        raise SpecError("spec.data.path: must stay inside the claim (no '..')")
    eps = _field(spec, "privacy.epsilon")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise SpecError("spec.privacy.epsilon: the run's epsilon, a number > 0")
    delta = _field(spec, "privacy.delta")
    if delta is not None and (isinstance(delta, bool) or not 0 < float(delta) < 1):
        raise SpecError("spec.privacy.delta: a number in (0, 1)")
    stages = tuple(spec.get("stages") or ())
    if not all(isinstance(s, str) and _STAGE.match(s) for s in stages):
        raise SpecError("spec.stages: stage names (data, base, train, ...)")
    overrides = tuple(spec.get("overrides") or ())
    for item in overrides:
        key = str(item).partition("=")[0]
        if "=" not in str(item) or key.startswith(("privacy.", "train.epsilon", "train.delta")):
            raise SpecError(
                f"spec.overrides: {item!r}: key=value, and not privacy.* or the run's epsilon "
                "and delta (spec.privacy sets them)"
            )
    queue = spec.get("queueName") or ""
    if queue and (not isinstance(queue, str) or not _DNS1123.match(queue)):
        raise SpecError("spec.queueName: the name of a Kueue LocalQueue")
    return RunSpec(
        queue_name=queue,
        config=text,
        data_claim=claim,
        data_path=posixpath.normpath(path),
        epsilon=float(eps),
        delta=None if delta is None else float(delta),
        stages=stages,
        overrides=overrides,
    )
