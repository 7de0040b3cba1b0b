"""The junior release writer: Stage I's DP artifact on disk, atomically, and nothing else.

:func:`write_release` builds a ``privcode-junior/1`` directory (the format and its
checks: :mod:`privcode.artifacts.junior`) from a peft adapter directory, the prefix
decoder D of latent methods and the privacy record. It refuses every tensor that is
not a LoRA weight or D's ``weight``/``bias`` and every extra file: the PrivLC encoders
E_c and E_p have seen private code and prompts and NEVER go in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.junior import (
    ADAPTER,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX_FILE,
    PRIVACY_JSON,
    RELEASE_JSON,
    check_meta,
    decoder_problem,
    listing,
    need,
    tensor_shapes,
)
from privcode.artifacts.privacy import PrivacyRecord
from privcode.utils import (
    PUBLIC_FILE_MODE,
    atomic_write_text,
    canonical_json,
    fsync_dir,
    replace_dir,
    sha256_file,
)

log = logging.getLogger("privcode.release")

__all__ = ["write_release"]

#: The only files copied from the adapter directory (README.md: peft's model card).
_ADAPTER_FILES = frozenset({ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md"})
_TOP_LEVEL = frozenset({RELEASE_JSON, PRIVACY_JSON, PREFIX_FILE, ADAPTER})


def _copy_adapter(src: Path, dst: Path) -> None:
    need(
        (src / ADAPTER_CONFIG).is_file() and (src / ADAPTER_WEIGHTS).is_file(),
        f"{src}: not a peft adapter directory (needs {ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})",
    )
    extra = sorted(p.name for p in src.iterdir() if p.name not in _ADAPTER_FILES)
    need(
        not extra,
        f"{src}: unexpected files {extra} (a release takes only "
        f"{sorted(_ADAPTER_FILES)}; extra tensor files are refused)",
    )
    dst.mkdir()
    for name in sorted(_ADAPTER_FILES):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    try:
        config = json.loads((dst / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{src / ADAPTER_CONFIG}: not JSON: {exc}") from exc
    need(
        isinstance(config, dict) and config.get("peft_type") == "LORA",
        f"{src / ADAPTER_CONFIG}: peft_type must be 'LORA'",
    )
    try:
        bad = sorted(k for k in tensor_shapes(dst / ADAPTER_WEIGHTS) if "lora_" not in k)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{src / ADAPTER_WEIGHTS}: not a safetensors file: {exc}") from exc
    need(
        not bad,
        f"{src / ADAPTER_WEIGHTS}: tensors that are not LoRA weights (no 'lora_' "
        f"in the key) must not be released: {bad[:5]}"
        + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""),
    )


def _write_decoder(path: Path, decoder: Any, prefix: dict[str, int]) -> None:
    from safetensors.torch import save_file

    need(
        isinstance(decoder, dict) and all(isinstance(v, torch.Tensor) for v in decoder.values()),
        "prefix_decoder must be a dict of tensors {'weight', 'bias'}",
    )
    problem = decoder_problem({k: tuple(v.shape) for k, v in decoder.items()}, prefix)
    need(problem is None, f"prefix_decoder: {problem}")
    need(
        all(v.is_floating_point() for v in decoder.values()),
        "prefix_decoder: weight and bias must be floating-point tensors",
    )
    save_file(
        {k: decoder[k].detach().cpu().contiguous().clone() for k in ("weight", "bias")}, str(path)
    )


def _replaceable(out: Path) -> bool:
    """``out`` is absent, empty, or holds only release entries (never, say, a home directory)."""
    if not out.exists() and not out.is_symlink():
        return True
    return (
        out.is_dir() and not out.is_symlink() and all(p.name in _TOP_LEVEL for p in out.iterdir())
    )


def write_release(
    out_dir: str | os.PathLike,
    *,
    adapter_dir: str | os.PathLike,
    meta: dict,
    privacy: PrivacyRecord,
    prefix_decoder: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a release to ``out_dir`` atomically; returns its path (see the module docstring).

    Everything is built in a temporary sibling directory, ``release.json``
    last, then swapped in by rename (an old ``out_dir`` is renamed aside
    first and deleted after), so ``out_dir`` never holds a half-written
    release. Raises ValueError (``out_dir`` untouched) on bad metadata, a
    bad or extra tensor or file, or an ``out_dir`` that is not a release.
    """
    out, adapter_dir = Path(out_dir), Path(adapter_dir)
    need(
        not (isinstance(meta, dict) and "files" in meta),
        "meta must not contain 'files': write_release computes it",
    )
    record = check_meta(meta)
    latent = record.conditioning == "latent"
    need(
        isinstance(privacy, PrivacyRecord),
        f"privacy must be a PrivacyRecord, got {type(privacy).__name__}",
    )
    need(
        privacy.dp is record.dp,
        f"privacy.dp = {privacy.dp!r} disagrees with meta['dp'] = {record.dp!r}",
    )
    need(
        not latent or prefix_decoder is not None,
        "a latent release needs its prefix decoder (prefix_decoder=None given)",
    )
    need(
        latent or prefix_decoder is None,
        f"a {record.conditioning!r} release must not contain a prefix decoder",
    )
    need(_replaceable(out), f"{out} exists and is not a release: refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        _copy_adapter(adapter_dir, tmp / ADAPTER)
        if prefix_decoder is not None:
            _write_decoder(tmp / PREFIX_FILE, prefix_decoder, record.prefix or {})
        atomic_write_text(tmp / PRIVACY_JSON, canonical_json(privacy.to_json()), PUBLIC_FILE_MODE)
        for rel in listing(tmp):
            with open(tmp / rel, "rb+") as fh:
                os.fsync(fh.fileno())
        files = {rel: sha256_file(tmp / rel) for rel in listing(tmp)}
        record = dataclasses.replace(record, files=files)
        atomic_write_text(tmp / RELEASE_JSON, canonical_json(record.to_json()), PUBLIC_FILE_MODE)
        fsync_dir(tmp / ADAPTER)
        fsync_dir(tmp)
        replace_dir(tmp, out)  # the old release moved aside, restored if the rename fails
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s release of method %s to %s", record.conditioning, record.method, out)
    return out
