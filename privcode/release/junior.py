"""The junior release: the ONLY artifact of Stage I that Stage II may read.

A release directory (format ``privcode-junior/1``) holds::

    adapter/                    peft ``save_pretrained`` output of the LoRA junior
                                (adapter_config.json, adapter_model.safetensors, README.md)
    prefix_decoder.safetensors  latent methods only: D's ``weight`` [K*H, dz] and ``bias`` [K*H]
    privacy.json                the privacy record (:class:`privcode.artifacts.PrivacyRecord`)
    release.json                written last: {"format", "method", "conditioning"
                                ("latent" | "prompt" | "none"), "dp", "base_model",
                                "prefix" ({"dz", "num_virtual_tokens", "hidden_size"} or
                                null), "alignment", "files": {relative path: sha256}}

``files`` lists every file but ``release.json``; :func:`verify_release`
refuses a release with a changed, missing or unlisted file. The base model
itself is public and is NOT copied: it is named by path.

What may go in, and nothing else: the LoRA weights (every tensor key of the
adapter contains ``lora_``) and the prefix decoder D (exactly ``weight``
and ``bias``). The PrivLC encoders E_c and E_p have seen private code and
prompts and are not needed to sample (Stage II draws ``z ~ N(0, I)``), so
their weights NEVER go in; :func:`write_release` refuses any other tensor
or file. :func:`scan_release` lets tests and audits check that no private
text made it into any file.

Generation contexts match Stage I training: latent releases prepend the K
virtual tokens ``D(z)`` (the last one predicts the first code token); prompt
releases start from ``prompt.rstrip() + "\\n"``; unconditional releases (and
an empty prompt) start from a single EOS token, the BOS stand-in the junior
was trained with.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from privcode.artifacts.privacy import PrivacyRecord
from privcode.artifacts.record import ArtifactError
from privcode.errors import PrivcodeError
from privcode.registry import METHODS
from privcode.utils import (
    PUBLIC_FILE_MODE,
    atomic_write_text,
    canonical_json,
    fsync_dir,
    replace_dir,
    sha256_file,
)

log = logging.getLogger("privcode.release")

__all__ = [
    "CONDITIONINGS",
    "FORMAT",
    "JuniorRelease",
    "ReleaseError",
    "load_release",
    "read_privacy",
    "scan_release",
    "verify_release",
    "write_release",
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
#: The only files copied from the adapter directory (README.md: peft's model card).
_ADAPTER_FILES = frozenset({ADAPTER_WEIGHTS, ADAPTER_CONFIG, "README.md"})
_TOP_LEVEL = frozenset({RELEASE_JSON, PRIVACY_JSON, PREFIX_FILE, ADAPTER})
#: Known methods -> their conditioning (other names are accepted with any conditioning).
METHOD_CONDITIONING = {name: m.conditioning for name, m in METHODS.items()}
_META_KEYS = {"format", "method", "conditioning", "dp", "base_model", "prefix", "alignment"}
_PREFIX_KEYS = ("dz", "num_virtual_tokens", "hidden_size")


class ReleaseError(PrivcodeError):
    """A release directory is missing, corrupt or inconsistent; names the file and the problem."""


# --------------------------------------------------------------------------- validation


def _need(ok: Any, message: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(message)


def _check_meta(meta: Any) -> dict[str, Any]:
    """The normalised release metadata (without "files"); ValueError naming the bad key."""
    _need(isinstance(meta, dict), f"meta must be a dict, got {type(meta).__name__}")
    unknown = sorted(set(meta) - _META_KEYS - {"files"})
    _need(not unknown, f"meta has unknown keys {unknown} (allowed: {sorted(_META_KEYS)})")
    _need(
        meta.get("format", FORMAT) == FORMAT,
        f"format is {meta.get('format')!r}, expected {FORMAT!r}",
    )
    method, cond, dp = meta.get("method"), meta.get("conditioning"), meta.get("dp")
    _need(
        isinstance(method, str) and method.strip(),
        f"method must be a non-empty string, got {method!r}",
    )
    _need(cond in CONDITIONINGS, f"conditioning must be one of {CONDITIONINGS}, got {cond!r}")
    expected = METHOD_CONDITIONING.get(method, cond)
    _need(expected == cond, f"method {method!r} conditions on {expected!r}, not {cond!r}")
    _need(isinstance(dp, bool), f"dp must be a bool, got {dp!r}")
    _need(not (method == "nondpft" and dp), "method 'nondpft' is not private: dp must be false")
    base, alignment = meta.get("base_model"), meta.get("alignment")
    _need(isinstance(base, str) and base, f"base_model must be a non-empty path, got {base!r}")
    _need(
        alignment is None or isinstance(alignment, str),
        f"alignment must be a string or null, got {alignment!r}",
    )
    prefix = meta.get("prefix")
    if cond == "latent":
        _need(
            isinstance(prefix, dict) and set(prefix) == set(_PREFIX_KEYS),
            f"a latent release needs prefix = {{{', '.join(_PREFIX_KEYS)}}}, got {prefix!r}",
        )
        for key in _PREFIX_KEYS:
            _need(
                type(prefix[key]) is int and prefix[key] >= 1,
                f"prefix[{key!r}] must be a positive int, got {prefix[key]!r}",
            )
        prefix = dict(prefix)
    else:
        _need(prefix is None, f"a {cond!r} release has no prefix decoder: prefix must be null")
    return {
        "format": FORMAT,
        "method": method,
        "conditioning": cond,
        "dp": dp,
        "base_model": base,
        "prefix": prefix,
        "alignment": alignment,
    }


def _decoder_problem(shapes: dict[str, tuple[int, ...]], prefix: dict[str, int]) -> str | None:
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


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return {key: tuple(fh.get_slice(key).get_shape()) for key in fh.keys()}


def _listing(root: Path) -> list[str]:
    """Relative POSIX paths of every file under ``root`` (a symlink is an error)."""
    out = []
    for p in sorted(root.rglob("*")):
        _need(not p.is_symlink(), f"{p}: symbolic links are not allowed in a release", ReleaseError)
        if p.is_file():
            out.append(p.relative_to(root).as_posix())
    return out


# --------------------------------------------------------------------------- writing


def _copy_adapter(src: Path, dst: Path) -> None:
    _need(
        (src / ADAPTER_CONFIG).is_file() and (src / ADAPTER_WEIGHTS).is_file(),
        f"{src}: not a peft adapter directory (needs {ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})",
    )
    extra = sorted(p.name for p in src.iterdir() if p.name not in _ADAPTER_FILES)
    _need(
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
    _need(
        isinstance(config, dict) and config.get("peft_type") == "LORA",
        f"{src / ADAPTER_CONFIG}: peft_type must be 'LORA'",
    )
    try:
        bad = sorted(k for k in _tensor_shapes(dst / ADAPTER_WEIGHTS) if "lora_" not in k)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{src / ADAPTER_WEIGHTS}: not a safetensors file: {exc}") from exc
    _need(
        not bad,
        f"{src / ADAPTER_WEIGHTS}: tensors that are not LoRA weights (no 'lora_' "
        f"in the key) must not be released: {bad[:5]}"
        + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""),
    )


def _write_decoder(path: Path, decoder: Any, prefix: dict[str, int]) -> None:
    from safetensors.torch import save_file

    _need(
        isinstance(decoder, dict) and all(isinstance(v, torch.Tensor) for v in decoder.values()),
        "prefix_decoder must be a dict of tensors {'weight', 'bias'}",
    )
    problem = _decoder_problem({k: tuple(v.shape) for k, v in decoder.items()}, prefix)
    _need(problem is None, f"prefix_decoder: {problem}")
    _need(
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
    _need(
        not (isinstance(meta, dict) and "files" in meta),
        "meta must not contain 'files': write_release computes it",
    )
    meta = _check_meta(meta)
    latent = meta["conditioning"] == "latent"
    _need(
        isinstance(privacy, PrivacyRecord),
        f"privacy must be a PrivacyRecord, got {type(privacy).__name__}",
    )
    _need(
        privacy.dp is meta["dp"],
        f"privacy.dp = {privacy.dp!r} disagrees with meta['dp'] = {meta['dp']!r}",
    )
    _need(
        not latent or prefix_decoder is not None,
        "a latent release needs its prefix decoder (prefix_decoder=None given)",
    )
    _need(
        latent or prefix_decoder is None,
        f"a {meta['conditioning']!r} release must not contain a prefix decoder",
    )
    _need(_replaceable(out), f"{out} exists and is not a release: refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        _copy_adapter(adapter_dir, tmp / ADAPTER)
        if prefix_decoder is not None:
            _write_decoder(tmp / PREFIX_FILE, prefix_decoder, meta["prefix"])
        atomic_write_text(tmp / PRIVACY_JSON, canonical_json(privacy.to_json()), PUBLIC_FILE_MODE)
        for rel in _listing(tmp):
            with open(tmp / rel, "rb+") as fh:
                os.fsync(fh.fileno())
        meta["files"] = {rel: sha256_file(tmp / rel) for rel in _listing(tmp)}
        atomic_write_text(tmp / RELEASE_JSON, canonical_json(meta), PUBLIC_FILE_MODE)
        fsync_dir(tmp / ADAPTER)
        fsync_dir(tmp)
        replace_dir(tmp, out)  # the old release moved aside, restored if the rename fails
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s release of method %s to %s", meta["conditioning"], meta["method"], out)
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


def verify_release(path: str | os.PathLike) -> dict:
    """``release.json`` of the release at ``path`` after checking it (ReleaseError if not).

    Checks: the format version and metadata, every listed file's sha256, no
    unlisted file, the required files, ``privacy.json``, the adapter's
    tensor keys and the prefix decoder's tensor names and shapes.
    """
    root = Path(path)
    manifest = root / RELEASE_JSON
    _need(root.is_dir(), f"{root}: release directory does not exist", ReleaseError)
    _need(
        manifest.is_file(),
        f"{manifest}: missing (not a release, or an interrupted write)",
        ReleaseError,
    )
    meta = _read_json(manifest)
    found = meta.get("format") if isinstance(meta, dict) else None
    _need(found == FORMAT, f"{manifest}: format is {found!r}, expected {FORMAT!r}", ReleaseError)
    try:
        checked = _check_meta(meta)
    except ValueError as exc:
        raise ReleaseError(f"{manifest}: {exc}") from exc
    files, cond = meta.get("files"), checked["conditioning"]
    _need(
        isinstance(files, dict) and all(isinstance(v, str) for v in files.values()),
        f"{manifest}: 'files' must map relative paths to sha256 digests",
        ReleaseError,
    )
    for rel, digest in sorted(files.items()):
        _need(
            not (
                rel.startswith("/") or "\\" in rel or ".." in rel.split("/") or rel == RELEASE_JSON
            ),
            f"{manifest}: invalid file entry {rel!r}",
            ReleaseError,
        )
        _need(
            (root / rel).is_file(),
            f"{root / rel}: listed in {RELEASE_JSON} but missing",
            ReleaseError,
        )
        _need(
            sha256_file(root / rel) == digest,
            f"{root / rel}: sha256 mismatch (modified or corrupted)",
            ReleaseError,
        )
    unlisted = [rel for rel in _listing(root) if rel != RELEASE_JSON and rel not in files]
    _need(
        not unlisted,
        f"{root / (unlisted or [''])[0]}: not listed in {RELEASE_JSON} (unexpected file)",
        ReleaseError,
    )
    required = [PRIVACY_JSON, f"{ADAPTER}/{ADAPTER_CONFIG}", f"{ADAPTER}/{ADAPTER_WEIGHTS}"]
    for rel in required + ([PREFIX_FILE] if cond == "latent" else []):
        _need(rel in files, f"{root / rel}: missing (required in a {cond!r} release)", ReleaseError)
    _need(
        cond == "latent" or PREFIX_FILE not in files,
        f"{root / PREFIX_FILE}: present in a {cond!r} release",
        ReleaseError,
    )
    privacy = read_privacy(root)
    _need(
        privacy.dp is checked["dp"],
        f"{root / PRIVACY_JSON}: dp = {privacy.dp!r} but "
        f"{RELEASE_JSON} says dp = {checked['dp']!r}",
        ReleaseError,
    )
    for rel in [f"{ADAPTER}/{ADAPTER_WEIGHTS}"] + ([PREFIX_FILE] if cond == "latent" else []):
        try:
            shapes = _tensor_shapes(root / rel)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise ReleaseError(f"{root / rel}: unreadable safetensors file: {exc}") from exc
        if rel == PREFIX_FILE:
            problem = _decoder_problem(shapes, checked["prefix"])
            _need(problem is None, f"{root / rel}: {problem}", ReleaseError)
        else:
            bad = sorted(k for k in shapes if "lora_" not in k)
            _need(not bad, f"{root / rel}: non-LoRA tensors {bad[:5]}", ReleaseError)
    return meta


# --------------------------------------------------------------------------- loading / sampling


@dataclass
class JuniorRelease:
    """A loaded release: tokenizer, LoRA junior (eval mode, on ``device``) and, if latent, D.

    ``dz`` and ``num_virtual_tokens`` (K) are None for a non-latent release.
    """

    path: Path
    meta: dict
    privacy: PrivacyRecord
    tokenizer: Any
    model: Any
    prefix_decoder: torch.nn.Linear | None
    device: str

    @property
    def conditioning(self) -> str:
        return self.meta["conditioning"]

    @property
    def dp(self) -> bool:
        return bool(self.meta["dp"])

    @property
    def dz(self) -> int | None:
        return (self.meta.get("prefix") or {}).get("dz")

    @property
    def num_virtual_tokens(self) -> int | None:
        return (self.meta.get("prefix") or {}).get("num_virtual_tokens")

    def _require_latent(self) -> None:
        _need(
            self.prefix_decoder is not None,
            f"{self.path}: a {self.conditioning!r} release has no latent prefix decoder",
            ReleaseError,
        )

    def prefix(self, z: torch.Tensor) -> torch.Tensor:
        """Virtual-token embeddings ``D(z)``: ``[B, dz] -> [B, K, hidden]``."""
        self._require_latent()
        shape = list(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        _need(
            isinstance(z, torch.Tensor) and z.dim() == 2 and z.shape[1] == self.dz,
            f"z must be a [B, {self.dz}] tensor, got {shape}",
        )
        weight = self.prefix_decoder.weight
        out = self.prefix_decoder(z.to(device=weight.device, dtype=weight.dtype))
        return out.view(z.shape[0], self.num_virtual_tokens, self.meta["prefix"]["hidden_size"])

    def sample_z(self, n: int, seed: int) -> torch.Tensor:
        """``n`` latents from N(0, I) (``[n, dz]``, CPU float32), from a generator seeded by ``seed``."""
        self._require_latent()
        _need(type(n) is int and n >= 1, f"n must be a positive int, got {n!r}")
        gen = torch.Generator().manual_seed(int(seed))
        return torch.randn(n, self.dz, generator=gen)

    def generate(
        self,
        *,
        n: int | None = None,
        z: torch.Tensor | None = None,
        prompts: list[str] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.8,
        top_p: float = 0.95,
        seed: int = 0,
        start: str = "",
    ) -> list[str]:
        """Sample code: the text generated after the context, up to (excluding) EOS.

        Latent: ``z`` [B, dz] (or ``n``: ``sample_z(n, seed)``); prompt:
        ``prompts``; none: ``n`` samples, each from a single EOS token.
        ``start`` (e.g. ``"def "``) is forced right after the context and
        is part of every returned string (a language prefix, public).
        ``temperature`` 0 is greedy; otherwise temperature + nucleus (``top_p``)
        sampling, reproducible for a given ``seed`` (the global RNG state is
        restored afterwards). Rows are batched (prompts are left-padded).
        """
        cond, tok = self.conditioning, self.tokenizer
        _need(
            isinstance(temperature, int | float) and temperature >= 0,
            f"temperature must be >= 0 (0 = greedy), got {temperature!r}",
        )
        _need(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p!r}")
        _need(max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}")
        _need(n is None or (type(n) is int and n >= 1), f"n must be a positive int, got {n!r}")
        _need(z is None or cond == "latent", f"z given, but this is a {cond!r} release")
        _need(
            prompts is None or cond == "prompt",
            f"prompts given, but this is a {cond!r} "
            f"release (pass {'z or n' if cond == 'latent' else 'n'})",
        )
        _need(isinstance(start, str), f"start must be a str, got {type(start).__name__}")
        start_ids = list(tok(start, add_special_tokens=False)["input_ids"]) if start else []
        emb = self.model.get_input_embeddings().weight
        if cond == "latent":
            _need(z is not None or n is not None, "a latent release needs z ([B, dz]) or n")
            with torch.no_grad():
                embeds = self.prefix(self.sample_z(n, seed) if z is None else z).to(emb.dtype)
                if start_ids:
                    forced = emb[torch.tensor(start_ids, device=emb.device)]
                    embeds = torch.cat([embeds, forced.expand(len(embeds), -1, -1)], dim=1)
            _need(n is None or n == len(embeds), f"n = {n} but z has {len(embeds)} rows")
            context = embeds.shape[1]
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=emb.device)
            inputs = {"inputs_embeds": embeds, "attention_mask": mask}
        else:
            if cond == "prompt":
                _need(
                    isinstance(prompts, list)
                    and prompts
                    and all(isinstance(p, str) for p in prompts),
                    "a prompt release needs prompts: a non-empty list of str",
                )
                _need(n is None or n == len(prompts), f"n = {n} but {len(prompts)} prompts given")
                # As in training: prompt.rstrip() + "\n"; an empty prompt gets the EOS context.
                contexts = [
                    list(tok(p.rstrip() + "\n", add_special_tokens=False)["input_ids"])
                    if p.strip()
                    else [tok.eos_token_id]
                    for p in prompts
                ]
            else:
                _need(n is not None, "an unconditional release needs n")
                contexts = [[tok.eos_token_id]] * n
            _need(
                all(None not in c for c in contexts),
                f"{self.path}: the tokenizer has no EOS",
                ReleaseError,
            )
            contexts = [c + start_ids for c in contexts]
            context, pad = max(len(c) for c in contexts), self._pad_id()
            ids = [[pad] * (context - len(c)) + c for c in contexts]  # left padding
            mask = [[0] * (context - len(c)) + [1] * len(c) for c in contexts]
            inputs = {
                "input_ids": torch.tensor(ids, device=emb.device),
                "attention_mask": torch.tensor(mask, device=emb.device),
            }
        limit = getattr(self.model.config, "max_position_embeddings", None)
        _need(
            not limit or context + max_new_tokens <= limit,
            f"context ({context} tokens) + "
            f"max_new_tokens ({max_new_tokens}) exceeds the model's {limit} positions",
        )
        out = self._sample(inputs, max_new_tokens, float(temperature), float(top_p), seed)
        if cond != "latent":
            out = out[:, context:]  # with input_ids, generate returns context + new tokens
        eos = tok.eos_token_id
        rows = [r[: r.index(eos)] if eos is not None and eos in r else r for r in out.tolist()]
        return [start + tok.decode(r, skip_special_tokens=True) for r in rows]

    def _pad_id(self) -> int:
        tok = self.tokenizer
        return next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)

    def _sample(
        self, kwargs: dict, max_new: int, temperature: float, top_p: float, seed: int
    ) -> torch.Tensor:
        eos = self.tokenizer.eos_token_id
        from privcode.models.sampling import sampling_kwargs

        options: dict[str, Any] = {
            "max_new_tokens": max_new,
            "pad_token_id": self._pad_id(),
            "eos_token_id": eos,
            **sampling_kwargs(temperature, top_p),
        }
        cuda = self.model.get_input_embeddings().weight.device.type == "cuda"
        devices = list(range(torch.cuda.device_count())) if cuda else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.random.default_generator.manual_seed(int(seed))
            if cuda:
                torch.cuda.manual_seed_all(int(seed))
            return self.model.generate(**kwargs, **options)


def _weights_dtype(dtype: torch.dtype | str | None, config: Any) -> torch.dtype:
    """None: float32; ``"auto"``: the base checkpoint's dtype (as ``load_causal_lm``)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(saved or "float32").removeprefix("torch.")
    resolved = getattr(torch, str(dtype), None)
    _need(
        isinstance(resolved, torch.dtype) and resolved.is_floating_point,
        f"dtype must be a floating torch dtype or its name (float32, bfloat16), got {dtype!r}",
    )
    return resolved  # type: ignore[return-value]


def load_release(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    base_model: str | None = None,
    merge: bool = True,
    dtype: torch.dtype | str | None = None,
) -> JuniorRelease:
    """Verify and load a release; ``base_model`` overrides the recorded base path.

    ``dtype`` (a torch dtype or its name; None = float32; ``"auto"`` = the
    base checkpoint's) is the dtype of the junior's weights on ``device``. The adapter is applied (and merged) in
    float32, the precision its DP update was made in, and only the result is
    cast, so a bf16 junior is one rounding of the float32 one. The prefix
    decoder D stays float32 (its output is cast to the embeddings' dtype).

    ``merge`` folds the LoRA update into the base weights (``W + (alpha/r) B A``,
    peft's ``merge_and_unload``): the same function, one matmul per layer
    instead of three, for every consumer (generation, scoring, serving) that
    only runs the model forward. ``merge=False`` keeps the PeftModel.

    A release with ``dp: false`` loads with a loud RuntimeWarning (and an
    error log): it is NOT PRIVATE and only fit for audits.
    """
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from privcode.models.loading import load_causal_lm, load_tokenizer

    root = Path(path)
    meta = verify_release(root)
    privacy = read_privacy(root)
    if not meta["dp"]:
        message = (
            f"release {root} (method {meta['method']}) is NOT PRIVATE: it was trained "
            "without differential privacy; use it for audits only, never for data "
            "that is shared"
        )
        log.error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    base_path = base_model or meta["base_model"]
    tokenizer = load_tokenizer(base_path)
    # Loaded in float32 onto the device (the merge is fast there), cast after the merge.
    base = load_causal_lm(base_path, device=device)
    prefix = meta.get("prefix")
    _need(
        not prefix or base.config.hidden_size == prefix["hidden_size"],
        f"{root / RELEASE_JSON}: prefix hidden_size {prefix and prefix['hidden_size']} != "
        f"{base.config.hidden_size} of the base model {base_path}: wrong base?",
        ReleaseError,
    )
    # Sampling follows generate()'s arguments only, never the base's generation defaults.
    base.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = PeftModel.from_pretrained(base, str(root / ADAPTER), is_trainable=False)
    if merge:
        model = model.merge_and_unload()
    model.to(device=device, dtype=_weights_dtype(dtype, base.config)).eval()
    decoder = None
    if prefix:
        tensors = load_file(str(root / PREFIX_FILE))
        decoder = torch.nn.Linear(
            prefix["dz"], prefix["num_virtual_tokens"] * prefix["hidden_size"]
        )
        with torch.no_grad():
            decoder.weight.copy_(tensors["weight"])
            decoder.bias.copy_(tensors["bias"])
        decoder.requires_grad_(False)
        decoder.to(device).eval()
    return JuniorRelease(
        path=root,
        meta=meta,
        privacy=privacy,
        tokenizer=tokenizer,
        model=model,
        prefix_decoder=decoder,
        device=str(device),
    )


# --------------------------------------------------------------------------- auditing


def scan_release(path: str | os.PathLike, needles: Iterable[str]) -> list[tuple[str, str]]:
    """``(relative file, needle)`` for every needle found in any file under ``path``.

    Raw bytes are searched (binary files too) for each needle's UTF-8 form
    and its JSON-escaped forms (a needle with a newline or quote inside a
    JSON file). Hits are logged by count only: needles are private text.
    """
    root = Path(path)
    needles = list(dict.fromkeys(needles))
    _need(all(isinstance(s, str) and s for s in needles), "needles must be non-empty strings")
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
