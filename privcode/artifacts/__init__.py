"""The on-disk formats privcode owns, as typed records (torch- and Ray-free).

Each format is a frozen dataclass with ``read``/``write`` (and ``from_json``/
``to_json``) that checks every key against its annotation, so a missing,
renamed or mistyped key is an :class:`ArtifactError` naming the file and the
key (:mod:`privcode.artifacts.record`). The formats of whole directories
(the junior release, the premium release) verify their files in
:mod:`privcode.release` and :mod:`privcode.premium`; the records they hold
live here:

* :class:`PrivacyRecord`: a junior release's ``privacy.json``.
* :class:`StageManifest`: a stage directory's ``manifest.json``.
* :class:`TrainSummary`, :class:`SynthSummary`: the train and synth stages' summaries.
* :class:`~privcode.artifacts.premium.PremiumRecord`: a premium release's
  ``premium.json`` (and :class:`~privcode.artifacts.premium.PremiumSummary`,
  the premium stage's summary).
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
