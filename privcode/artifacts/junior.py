"""The junior release format: the ONLY artifact of Stage I that Stage II may read.

A release directory (format ``privcode-junior/1``) holds::

    adapter/                    peft ``save_pretrained`` output of the LoRA junior
                                (adapter_config.json, adapter_model.safetensors, README.md)
    prefix_decoder.safetensors  latent methods only: D's ``weight`` [K*H, dz] and ``bias`` [K*H]
    privacy.json                the privacy record (:class:`privcode.artifacts.PrivacyRecord`)
    release.json                written last (:class:`ReleaseRecord`): {"format", "method",
                                "conditioning" ("latent" | "prompt" | "none"), "dp",
                                "base_model", "prefix" ({"dz", "num_virtual_tokens",
                                "hidden_size"} or null), "alignment", "files": {relative
                                path: sha256}}

``files`` lists every file but ``release.json``; :func:`verify_release`
refuses a release with a changed, missing or unlisted file. The base model
itself is public and is NOT copied: it is named by path.

What may go in, and nothing else: the LoRA weights (every tensor key of the
adapter contains ``lora_``) and the prefix decoder D (exactly ``weight``
and ``bias``). The PrivLC encoders E_c and E_p have seen private code and
prompts and are not needed to sample (Stage II draws ``z ~ N(0, I)``), so
their weights NEVER go in; the writer (:func:`privcode.train.release.write_release`)
refuses any other tensor or file. :func:`scan_release` lets tests and audits check
that no private text made it into any file. The loader is
:func:`privcode.models.junior.load_release`.

This module reads and checks the format only: no torch, no Ray (tensor names and
shapes come from the safetensors header, :func:`tensor_shapes`).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts.privacy import PrivacyRecord
from privcode.artifacts.record import ArtifactError, JsonRecord
from privcode.errors import PrivcodeError
from privcode.registry import METHODS
from privcode.utils import sha256_file

log = logging.getLogger("privcode.release")

__all__ = [
    "CONDITIONINGS",
    "FORMAT",
    "ReleaseError",
    "ReleaseRecord",
    "check_meta",
    "decoder_problem",
    "listing",
    "need",
    "read_privacy",
    "scan_release",
    "tensor_shapes",
    "verify_release",
]

FORMAT = "privcode-junior/1"
CONDITIONINGS = ("latent", "prompt", "none")
RELEASE_JSON, PRIVACY_JSON, PREFIX_FILE, ADAPTER = (
    "release.json",
    "privacy.json",
    "prefix_decoder.safetensors",
    "adapter",
)
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
#: Known methods -> their conditioning (other names are accepted with any conditioning).
METHOD_CONDITIONING = {name: m.conditioning for name, m in METHODS.items()}
_PREFIX_KEYS = ("dz", "num_virtual_tokens", "hidden_size")
#: A safetensors header larger than this is not a release file (the format caps it at 100 MB).
_MAX_HEADER = 100 << 20


class ReleaseError(PrivcodeError):
    """A release directory is missing, corrupt or inconsistent; names the file and the problem."""


def need(ok: Any, message: str, exc: type[Exception] = ValueError) -> None:
    """Raise ``exc(message)`` unless ``ok``."""
    if not ok:
        raise exc(message)


@dataclass(frozen=True)
class ReleaseRecord(JsonRecord):
    """``release.json``: what the junior was trained to condition on, and every file's sha256.

    ``files`` is empty until the writer has listed the directory; a ValueError
    (an :class:`ArtifactError` when read) names the bad key.
    """

    FILE = RELEASE_JSON

    method: str
    conditioning: str
    dp: bool
    base_model: str
    format: str = FORMAT
    prefix: dict[str, Any] | None = None
    alignment: str | None = None
    files: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        need(self.format == FORMAT, f"format is {self.format!r}, expected {FORMAT!r}")
        method, cond = self.method, self.conditioning
        need(method.strip(), f"method must be a non-empty string, got {method!r}")
        need(cond in CONDITIONINGS, f"conditioning must be one of {CONDITIONINGS}, got {cond!r}")
        expected = METHOD_CONDITIONING.get(method, cond)
        need(expected == cond, f"method {method!r} conditions on {expected!r}, not {cond!r}")
        need(
            not (method == "nondpft" and self.dp),
            "method 'nondpft' is not private: dp must be false",
        )
        need(self.base_model, f"base_model must be a non-empty path, got {self.base_model!r}")
        prefix = self.prefix
        if cond != "latent":
            need(prefix is None, f"a {cond!r} release has no prefix decoder: prefix must be null")
            return
        if not (isinstance(prefix, dict) and set(prefix) == set(_PREFIX_KEYS)):
            keys = ", ".join(_PREFIX_KEYS)
            raise ValueError(f"a latent release needs prefix = {{{keys}}}, got {prefix!r}")
        for key in _PREFIX_KEYS:
            need(
                type(prefix[key]) is int and prefix[key] >= 1,
                f"prefix[{key!r}] must be a positive int, got {prefix[key]!r}",
            )


def check_meta(meta: Any, where: str = "meta") -> ReleaseRecord:
    """The release metadata as a checked :class:`ReleaseRecord`; ValueError naming ``where``
    and the bad key."""
    need(isinstance(meta, dict), f"{where} must be a dict, got {type(meta).__name__}")
    return ReleaseRecord.from_json(meta, where)


def decoder_problem(shapes: dict[str, tuple[int, ...]], prefix: dict[str, int]) -> str | None:
    """None if D's tensor names and shapes fit ``prefix``, else what is wrong."""
    out = prefix["num_virtual_tokens"] * prefix["hidden_size"]
    expected = {"weight": (out, prefix["dz"]), "bias": (out,)}
    if set(shapes) != set(expected):
        return f"tensors must be exactly ['bias', 'weight'], got {sorted(shapes)}"
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            return (
                f"{key} has shape {list(shapes[key])}, expected {list(shape)} from meta['prefix']"
            )
    return None


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header; ValueError if it is not one.

    Read here from the documented header (an 8-byte little-endian length, then a JSON
    object of ``{name: {dtype, shape, data_offsets}}``) because safetensors' own reader
    imports torch or numpy for its framework, and the format checks stay free of both.
    The offsets must tile the data section exactly, as safetensors itself requires.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        need(len(head) == 8, "shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        need(n <= min(_MAX_HEADER, size - 8), f"header length {n} does not fit the file")
        header = json.loads(fh.read(n).decode("utf-8"))
    need(isinstance(header, dict), "the header is not a JSON object")
    shapes, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        need(isinstance(entry, dict), f"tensor {name!r}: not a JSON object")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        need(
            isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape),
            f"tensor {name!r}: bad shape",
        )
        need(
            isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1],
            f"tensor {name!r}: bad data_offsets",
        )
        shapes[name] = tuple(shape)
        spans.append(tuple(offsets))
    end = 0
    for start, stop in sorted(spans):
        need(start == end, "tensor data offsets leave a gap or overlap")
        end = stop
    need(end == size - 8 - n, "tensor data does not fill the file")
    return shapes


def listing(root: Path) -> list[str]:
    """Relative POSIX paths of every file under ``root`` (a symlink is an error)."""
    out = []
    for p in sorted(root.rglob("*")):
        need(not p.is_symlink(), f"{p}: symbolic links are not allowed in a release", ReleaseError)
        if p.is_file():
            out.append(p.relative_to(root).as_posix())
    return out


# --------------------------------------------------------------------------- verifying


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReleaseError(f"{path}: not readable JSON: {exc}") from exc


def read_privacy(release: str | os.PathLike) -> PrivacyRecord:
    """The release's typed privacy record; ReleaseError naming the file and the bad key."""
    try:
        return PrivacyRecord.read(Path(release) / PRIVACY_JSON)
    except ArtifactError as exc:
        raise ReleaseError(str(exc)) from None


def _check_files(root: Path, manifest: Path, files: Any, cond: str) -> None:
    """Every listed file present with its sha256, nothing unlisted, the required ones there."""
    need(
        isinstance(files, dict) and all(isinstance(v, str) for v in files.values()),
        f"{manifest}: 'files' must map relative paths to sha256 digests",
        ReleaseError,
    )
    for rel, digest in sorted(files.items()):
        need(
            not (
                rel.startswith("/") or "\\" in rel or ".." in rel.split("/") or rel == RELEASE_JSON
            ),
            f"{manifest}: invalid file entry {rel!r}",
            ReleaseError,
        )
        need(
            (root / rel).is_file(),
            f"{root / rel}: listed in {RELEASE_JSON} but missing",
            ReleaseError,
        )
        need(
            sha256_file(root / rel) == digest,
            f"{root / rel}: sha256 mismatch (modified or corrupted)",
            ReleaseError,
        )
    unlisted = [rel for rel in listing(root) if rel != RELEASE_JSON and rel not in files]
    need(
        not unlisted,
        f"{root / (unlisted or [''])[0]}: not listed in {RELEASE_JSON} (unexpected file)",
        ReleaseError,
    )
    required = [PRIVACY_JSON, f"{ADAPTER}/{ADAPTER_CONFIG}", f"{ADAPTER}/{ADAPTER_WEIGHTS}"]
    for rel in required + ([PREFIX_FILE] if cond == "latent" else []):
        need(rel in files, f"{root / rel}: missing (required in a {cond!r} release)", ReleaseError)
    need(
        cond == "latent" or PREFIX_FILE not in files,
        f"{root / PREFIX_FILE}: present in a {cond!r} release",
        ReleaseError,
    )


def _check_tensors(root: Path, record: ReleaseRecord) -> None:
    """The adapter holds LoRA tensors only; D has exactly the shapes ``prefix`` says."""
    latent = record.conditioning == "latent"
    for rel in [f"{ADAPTER}/{ADAPTER_WEIGHTS}"] + ([PREFIX_FILE] if latent else []):
        try:
            shapes = tensor_shapes(root / rel)
        except (OSError, ValueError) as exc:
            raise ReleaseError(f"{root / rel}: unreadable safetensors file: {exc}") from exc
        if rel == PREFIX_FILE:
            problem = decoder_problem(shapes, record.prefix or {})
            need(problem is None, f"{root / rel}: {problem}", ReleaseError)
        else:
            bad = sorted(k for k in shapes if "lora_" not in k)
            need(not bad, f"{root / rel}: non-LoRA tensors {bad[:5]}", ReleaseError)


def verify_release(path: str | os.PathLike) -> dict[str, Any]:
    """``release.json`` of the release at ``path`` after checking it (ReleaseError if not).

    Checks: the format version and metadata, every listed file's sha256, no
    unlisted file, the required files, ``privacy.json``, the adapter's
    tensor keys and the prefix decoder's tensor names and shapes.
    """
    root = Path(path)
    manifest = root / RELEASE_JSON
    need(root.is_dir(), f"{root}: release directory does not exist", ReleaseError)
    need(
        manifest.is_file(),
        f"{manifest}: missing (not a release, or an interrupted write)",
        ReleaseError,
    )
    meta = _read_json(manifest)
    found = meta.get("format") if isinstance(meta, dict) else None
    need(found == FORMAT, f"{manifest}: format is {found!r}, expected {FORMAT!r}", ReleaseError)
    try:
        record = check_meta(meta, str(manifest))
    except ValueError as exc:
        raise ReleaseError(str(exc)) from exc
    _check_files(root, manifest, meta.get("files"), record.conditioning)
    privacy = read_privacy(root)
    need(
        privacy.dp is record.dp,
        f"{root / PRIVACY_JSON}: dp = {privacy.dp!r} but {RELEASE_JSON} says dp = {record.dp!r}",
        ReleaseError,
    )
    _check_tensors(root, record)
    return record.to_json()


# --------------------------------------------------------------------------- auditing


def scan_release(path: str | os.PathLike, needles: Iterable[str]) -> list[tuple[str, str]]:
    """``(relative file, needle)`` for every needle found in any file under ``path``.

    Raw bytes are searched (binary files too) for each needle's UTF-8 form
    and its JSON-escaped forms (a needle with a newline or quote inside a
    JSON file). Hits are logged by count only: needles are private text.
    """
    root = Path(path)
    needles = list(dict.fromkeys(needles))
    need(all(isinstance(s, str) and s for s in needles), "needles must be non-empty strings")
    forms = {
        s: {
            s.encode("utf-8"),
            json.dumps(s, ensure_ascii=False)[1:-1].encode("utf-8"),
            json.dumps(s)[1:-1].encode("utf-8"),
        }
        for s in needles
    }
    overlap = max((len(f) for fs in forms.values() for f in fs), default=1) - 1
    hits: list[tuple[str, str]] = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        found: set[str] = set()
        with open(p, "rb") as fh:
            tail = b""
            while block := fh.read(1 << 22):
                window = tail + block
                found |= {s for s, fs in forms.items() if any(f in window for f in fs)}
                tail = window[-overlap:] if overlap else b""
        rel = p.relative_to(root).as_posix()
        hits += [(rel, s) for s in needles if s in found]
    if hits:
        log.warning(
            "scan of %s: %d needle hit(s) in %d file(s)", root, len(hits), len({f for f, _ in hits})
        )
    return hits
