"""The on-disk formats privcode owns, as typed records (torch- and Ray-free).

Each format is a frozen dataclass with ``read``/``write`` (and ``from_json``/
``to_json``) that checks every key against its annotation, so a missing,
renamed or mistyped key is an :class:`ArtifactError` naming the file and the
key (:mod:`privcode.artifacts.record`). The formats of whole directories
(the junior release, the premium release) verify their files in
:mod:`privcode.artifacts.junior` and :mod:`privcode.premium`; the records they hold
live here:

* :class:`PrivacyRecord`: a junior release's ``privacy.json``.
* :class:`StageManifest`: a stage directory's ``manifest.json``.
* :class:`~privcode.artifacts.base.BaseRecord`: the base stage's ``base.json``
  (also its summary).
* :class:`~privcode.artifacts.premium.PremiumRecord`: a premium release's
  ``premium.json``; :class:`~privcode.artifacts.nondp.NondpRecord`: the
  non-DP comparison's ``nondp.json``; :class:`~privcode.artifacts.pac.
  PacWorldsRecord`: the PAC worlds' ``pac.json``.
* :mod:`privcode.artifacts.summaries`: the other stages' summaries
  (``TrainSummary``, ``SynthSummary``, ``AuditSummary``, ...).
"""

from privcode.artifacts.manifest import StageManifest
from privcode.artifacts.privacy import PrivacyRecord
from privcode.artifacts.record import ArtifactError, JsonRecord
from privcode.artifacts.summaries import SynthSummary, TrainSummary

__all__ = [
    "ArtifactError",
    "JsonRecord",
    "PrivacyRecord",
    "StageManifest",
    "SynthSummary",
    "TrainSummary",
]
