"""One loader for every model artifact privcode writes or reads: :func:`load_model`.
Design notes: docs/architecture.md, "models/artifacts.py".

Every consumer that runs a model forward (pass@k eval, the audits' scorer, leak probing,
premium serving) loads it here. A directory's marker file tells its kind, checked in this
order: ``release.json`` (a junior release, :func:`privcode.models.junior.load_release`),
``premium.json``, ``adapter_config`` (a peft adapter), ``nondp.json`` (NOT PRIVATE),
``base.json``, otherwise a Hugging Face model directory or a preset name (``demo``).

LoRA adapters are merged (``W + (alpha/r) B A``). The model is in eval mode with
``requires_grad`` off; sampling follows the caller's arguments, never a checkpoint's
``generation_config`` (its end-of-sequence ids are kept in :attr:`LoadedModel.eos_ids`).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from privcode.artifacts import ArtifactError
from privcode.artifacts.base import BaseRecord
from privcode.artifacts.nondp import NondpRecord
from privcode.artifacts.premium import PremiumRecord
from privcode.models.junior import load_release
from privcode.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from privcode.utils import read_json_object, replace_dir

__all__ = [
    "MERGED_DIR",
    "MERGED_MARKER",
    "MODEL_KINDS",
    "LoadedModel",
    "export_merged",
    "load_model",
    "model_kind",
]

log = logging.getLogger(__name__)

#: What :func:`model_kind` can return, in the order the markers are checked.
MODEL_KINDS = ("junior", "premium", "adapter", "nondpft", "base-stage", "model")
_MARKERS = (
    ("junior", "release.json"),
    ("premium", "premium.json"),
    ("adapter", "adapter_config.json"),
    ("nondpft", "nondp.json"),
)
#: A premium release's merged checkpoint (for engines that load a plain HF model: vLLM).
MERGED_DIR = "merged"
#: Its provenance: the release it was merged from and that release's privacy block.
MERGED_MARKER = "privcode-merged.json"


@dataclass
class LoadedModel:
    """A model ready for forward passes, with what its directory says about it.

    ``kind`` is one of :data:`MODEL_KINDS` (``base-stage`` loads as ``model``);
    ``base_model`` the base it was built on (None for a plain model); ``meta``
    the marker file's JSON; ``release`` the :class:`~privcode.models.junior.JuniorRelease`
    of a junior (its privacy record, prefix decoder and conditioning).
    """

    kind: str
    path: Path
    model: Any
    tokenizer: Any
    base_model: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    release: Any = None
    eos_ids: tuple[int, ...] = ()

    @property
    def dp(self) -> bool:
        """True only for a DP junior release and a premium model trained from one."""
        if self.kind == "junior":
            return bool(self.release.dp)
        if self.kind == "premium":
            return bool((self.meta.get("privacy") or {}).get("dp"))
        return False


def model_kind(path: str | Path) -> str:
    """The kind of artifact at ``path`` by its marker file (see the module docstring)."""
    root = Path(str(path)).expanduser()
    for kind, marker in _MARKERS:
        if (root / marker).is_file():
            return kind
    if (root / BaseRecord.FILE).is_file() and not (root / "config.json").is_file():
        return "base-stage"
    return "model"


def _recorded_base(
    meta_path: Path, meta: dict[str, Any], key: str, base_model: str | None, hint: str
) -> str:
    base = base_model or meta.get(key)
    if not isinstance(base, str) or not base:
        raise ModelLoadError(f"{meta_path}: no base model path ({key!r}); {hint}")
    return base


def _checkpoint_eos(model: Any, tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tokenizer.eos_token_id if eos is None else eos
    return tuple(eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos]))


def _ready(model: Any, tokenizer: Any, device: Any) -> tuple[Any, tuple[int, ...]]:
    """Neutral generation defaults, ``device``, eval mode, no gradients."""
    from transformers import GenerationConfig

    eos_ids = _checkpoint_eos(model, tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, eos_ids


def _base_and_adapter(
    base: str, adapter_dir: Path, *, device: Any, dtype: Any, cache_dir: str | None
) -> tuple[Any, Any, tuple[int, ...]]:
    from peft import PeftModel

    tokenizer = load_tokenizer(base, cache_dir=cache_dir)
    lm = load_causal_lm(base, dtype=dtype, device=device, cache_dir=cache_dir)
    eos_ids = _checkpoint_eos(lm, tokenizer)
    try:
        lm = PeftModel.from_pretrained(lm, str(adapter_dir), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(
            f"{adapter_dir}: cannot apply the adapter to base model {base}: {exc}"
        ) from exc
    model, _ = _ready(lm.merge_and_unload(), tokenizer, device)
    return model, tokenizer, eos_ids


def load_model(
    path: str | Path,
    *,
    base_model: str | None = None,
    device: Any = "cpu",
    dtype: Any = None,
    cache_dir: str | None = None,
) -> LoadedModel:
    """Load the artifact at ``path`` (any of the module docstring's kinds) on ``device``.

    ``base_model`` overrides the base path a release or adapter records (for a
    release moved from the machine it was trained on); ``dtype`` as in
    :func:`~privcode.models.loading.load_causal_lm` (a junior release merges its
    adapter in float32, the precision its DP update was made in, then casts). Raises
    :class:`ModelLoadError` naming the file at fault; a junior release that
    fails verification raises :class:`~privcode.artifacts.junior.ReleaseError`.
    """
    root = Path(str(path)).expanduser()
    kind = model_kind(root)
    if kind == "junior":
        rel = load_release(root, device=str(device), base_model=base_model, dtype=dtype)
        return LoadedModel(
            kind,
            root,
            rel.model,
            rel.tokenizer,
            base_model=base_model or rel.meta["base_model"],
            meta=rel.meta,
            release=rel,
            eos_ids=_checkpoint_eos(rel.model, rel.tokenizer),
        )
    if kind in ("premium", "adapter"):
        marker = root / ("premium.json" if kind == "premium" else "adapter_config.json")
        if kind == "premium":  # the typed record: a release without its privacy block is refused
            try:
                meta = PremiumRecord.read(marker).to_json()
            except ArtifactError as exc:
                raise ModelLoadError(f"not a premium release: {exc}") from None
        else:
            meta = read_json_object(marker, ModelLoadError)
        key = "model" if kind == "premium" else "base_model_name_or_path"
        base = _recorded_base(
            marker,
            meta,
            key,
            base_model,
            "if the base model lives elsewhere on this machine, pass its path",
        )
        adapter_dir = root / "adapter" if kind == "premium" else root
        model, tokenizer, eos_ids = _base_and_adapter(
            base, adapter_dir, device=device, dtype=dtype, cache_dir=cache_dir
        )
        return LoadedModel(
            kind, root, model, tokenizer, base_model=base, meta=meta, eos_ids=eos_ids
        )
    meta = {}
    target: str | Path = root if root.exists() else str(path)  # a preset name
    if kind == "nondpft":
        try:
            meta = NondpRecord.read(root / NondpRecord.FILE).to_json()
        except ArtifactError as exc:
            raise ModelLoadError(f"not a non-DP comparison: {exc}") from None
        log.warning("loading %s: trained WITHOUT differential privacy (NOT PRIVATE)", root)
    elif kind == "base-stage":
        try:
            record = BaseRecord.read(root / BaseRecord.FILE)
        except ArtifactError as exc:
            raise ModelLoadError(f"not a base stage: {exc}; rebuild the base stage") from None
        meta, kind, target = record.to_json(), "model", record.path
    tokenizer = load_tokenizer(target, cache_dir=cache_dir)
    lm = load_causal_lm(target, dtype=dtype, device=device, cache_dir=cache_dir)
    model, eos_ids = _ready(lm, tokenizer, device)
    return LoadedModel(
        kind,
        root,
        model,
        tokenizer,
        base_model=meta.get("base_model") if kind == "nondpft" else None,
        meta=meta,
        eos_ids=eos_ids,
    )


def export_merged(
    release: str | Path,
    *,
    base_model: str | None = None,
    dtype: str = "bfloat16",
    out: str | Path | None = None,
) -> Path:
    """Write a premium release's model as one Hugging Face checkpoint: ``<release>/merged/``.

    Base + adapter merged (``W + (alpha/r) B A``, as :func:`load_model` does), saved as
    safetensors in ``dtype`` with the tokenizer and the checkpoint's end-of-sequence ids, so
    an engine that takes a plain model directory (vLLM) serves exactly the premium model.
    :data:`MERGED_MARKER` records the base model and the release's ``privacy`` block (the merged
    weights inherit the release's guarantee, by post-processing). Written to a temporary
    directory, then renamed: a crash leaves no half checkpoint, and an existing ``merged/``
    is replaced only by a complete one. Returns the checkpoint's directory.
    """

    import torch

    root = Path(str(release)).expanduser().resolve()
    if model_kind(root) != "premium":
        raise ModelLoadError(f"{root}: not a premium release (no premium.json)")
    target = Path(str(out)).expanduser().resolve() if out else root / MERGED_DIR
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelLoadError(f"export_merged: {dtype!r} is not a torch dtype")
    # Merge in float32 (the adapter's precision), then cast once.
    loaded = load_model(root, base_model=base_model, device="cpu", dtype=torch.float32)
    model = loaded.model.to(torch_dtype)
    model.generation_config.eos_token_id = list(loaded.eos_ids) or None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from a replica running as another user
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        loaded.tokenizer.save_pretrained(str(tmp))
        marker = {
            "format": 1,
            "adapter": "../adapter",
            "base_model": loaded.base_model,
            "dtype": dtype,
            "privacy": loaded.meta.get("privacy"),
        }
        (tmp / MERGED_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("premium release %s merged into %s (%s)", root, target, dtype)
    return target
