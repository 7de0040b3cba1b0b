"""The m worlds and the public base as one batched model: PAC-private generation without Ray.

:class:`PacEnsemble` loads a worlds artifact of :mod:`privcode.pac.worlds` (``pac.json``,
``adapters/<name>/``): the base ONCE and all ``m`` adapters, stacked
(:class:`privcode.models.multi_lora.StackedLora`; peft's mixed-adapter batch as fallback). One
KV-cached forward computes ``m + 1`` rows of a context: row ``s < m`` through world ``s``, row
``m`` the plain base. Per token (:meth:`PacEnsemble.generate`): candidates ``V_t`` = top-k of
the PUBLIC row, the worlds' full-vocabulary log-softmax gathered at ``V_t``; votes
(:func:`privcode.pac.mechanism.world_votes`: greedy, or ``argmax_v (log p_s(v) / tau + G_v)``
with ONE public Gumbel draw ``G``); the curator (:class:`privcode.pac.curator.Curator`) releases
a candidate or answers "fallback" (then the PUBLIC row's ``argmax_v (log p_pub(v) [/ tau +
G_v])``, free); the token extends every row. EOS, a stop string (cut before it) or
``max_tokens`` stop it; a spent budget does not (fallback tokens).

The worlds are trained WITHOUT DP: the artifact and everything computed from it but the
curator's releases stay inside the server; prompts, completions, votes and log-probs are never
logged, only sizes and timings. Design notes: docs/serving.md, "privcode/pac/ensemble.py".
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from privcode.artifacts.pac import BASE_ROW, WORLDS_FORMAT, PacWorldsRecord
from privcode.artifacts.record import ArtifactError
from privcode.errors import PrivcodeError
from privcode.utils import sha256_file

log = logging.getLogger("privcode.pac")

__all__ = [
    "BASE_ROW",
    "MANIFEST",
    "WORLDS_FORMAT",
    "PacCompletion",
    "PacEnsemble",
    "PacEnsembleError",
    "StepLogprobs",
    "read_manifest",
    "worlds_digest",
]

MANIFEST = PacWorldsRecord.FILE
#: peft's name for "no adapter" in a mixed batch: the public row.
_DEVICES = ("auto", "cpu", "cuda")
_BATCHING = ("stacked", "peft")


class PacEnsembleError(PrivcodeError, ValueError):
    """A worlds artifact, model or generation request is unusable (names the key, path or value)."""


@dataclass(frozen=True)
class StepLogprobs:
    """Next-token log-probabilities over the candidate set ``V_t`` (SERVER-INTERNAL)."""

    candidates: np.ndarray  #: [k] token ids, the public row's top-k, best first
    worlds: np.ndarray  #: [m, k] float64: world s's log-softmax at the candidates
    public: np.ndarray  #: [k] float64: the public base's log-softmax at the candidates


@dataclass(frozen=True)
class PacCompletion:
    """A PAC-private completion and its accounting (all of it may be shown to the client)."""

    text: str
    token_ids: tuple[int, ...]  #: every released token, EOS included when it ended the text
    finish_reason: str  #: "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    private_tokens: int  #: tokens charged b nats each
    free_tokens: int  #: unanimous tokens (no charge)
    fallback_tokens: int  #: public-model tokens emitted because a budget was spent
    charged_nats: float  #: b * private_tokens
    #: A budget could not pay for a token and ``on_exhausted="stop"`` ended the text there.
    exhausted: bool = False


def worlds_digest(worlds_dir: str | Path) -> bytes:
    """SHA-256 over ``pac.json`` and every file of every world's adapter (names and content).

    Names the worlds for the privacy store (keyed there: :meth:`PrivacyStore.opaque`),
    so the same worlds, wherever they are copied, find the same curator state.
    """
    root = Path(worlds_dir).expanduser()
    info = read_manifest(root)
    h = hashlib.sha256(b"privcode-pac-worlds/1\0")
    h.update(sha256_file(root / PacWorldsRecord.FILE).encode())
    for name in info.worlds:
        adapter = root / "adapters" / name
        for path in sorted(p for p in adapter.rglob("*") if p.is_file()):
            h.update(f"\0{name}/{path.relative_to(adapter).as_posix()}\0".encode())
            h.update(sha256_file(path).encode())
    return h.digest()


def read_manifest(worlds_dir: str | Path, *, model: str | None = None) -> PacWorldsRecord:
    """The validated ``pac.json`` of a worlds artifact; :class:`PacEnsembleError` names the problem.

    The record (:class:`~privcode.artifacts.pac.PacWorldsRecord`) checks the
    format, ``m`` (an integer >= 2), ``worlds`` (``m`` distinct names safe as
    directory names); here ``base_model`` (unless ``model`` overrides it) and
    that ``adapters/<name>/adapter_config.json`` exists for every world.
    Loads nothing.
    """
    root = Path(worlds_dir).expanduser()
    path = root / PacWorldsRecord.FILE
    if not path.is_file():
        raise PacEnsembleError(
            f"{root}: not a PAC worlds artifact (no {PacWorldsRecord.FILE}); pass the "
            "directory `privcode pac worlds` wrote"
        )
    try:
        info = PacWorldsRecord.read(path)
        info.verify(root)
    except ArtifactError as exc:
        raise PacEnsembleError(str(exc)) from None
    base = model if model is not None else info.base_model
    if not isinstance(base, str) or not base.strip():
        raise PacEnsembleError(
            f"{path}: 'base_model' must be a model directory path (or pass "
            f"the model override), got {base!r}"
        )
    return dataclasses.replace(info, base_model=base)


def _resolve_device(device: str):
    import torch

    if device not in _DEVICES:
        raise PacEnsembleError(f"device must be one of {', '.join(_DEVICES)}, got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PacEnsembleError("device 'cuda' requested but no CUDA device is visible")
    return torch.device(device)


class PacEnsemble:
    """Base model + m world adapters in one peft model; see the module docstring.

    ``model``: base-model path overriding ``pac.json``'s ``base_model``.
    ``dtype``: None = float32 on CPU, bfloat16 (or float16) on CUDA; else a
    torch dtype or its name. ``top_k``: size of the candidate set ``V_t``.
    ``batching``: ``"stacked"`` (default; falls back to peft's, with a warning, for adapters
    it refuses) or ``"peft"`` (peft's mixed-adapter batch: slower, kept as a reference).
    """

    def __init__(
        self,
        worlds_dir: str | Path,
        *,
        model: str | None = None,
        device: str = "auto",
        top_k: int = 50,
        dtype: Any = None,
        batching: str = "stacked",
    ):
        import torch
        from peft import PeftModel

        from privcode.models.loading import ModelLoadError, load_causal_lm, load_tokenizer

        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise PacEnsembleError(f"top_k must be an integer >= 1, got {top_k!r}")
        if batching not in _BATCHING:
            raise PacEnsembleError(
                f"batching must be one of {', '.join(_BATCHING)}, got {batching!r}"
            )
        root = Path(worlds_dir).expanduser()
        info = read_manifest(root, model=model)
        self.worlds: tuple[str, ...] = info.worlds
        self.m, self.top_k, self.base = len(self.worlds), top_k, str(info.base_model)
        self.device = _resolve_device(device)
        if dtype is None:
            dtype = torch.float32
            if self.device.type == "cuda":
                dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        start = time.perf_counter()
        try:
            self.tokenizer = load_tokenizer(self.base)
            lm = load_causal_lm(self.base, dtype=dtype, device=self.device)
        except ModelLoadError as exc:
            how = "" if model else "; pass the model override if the base lives elsewhere"
            raise PacEnsembleError(
                f"worlds artifact {root}: cannot load the base model: {exc}{how}"
            ) from exc
        keep = inspect.signature(type(lm).forward).parameters
        # Only the last position's logits are needed: [m+1, vocab], not [m+1, prompt, vocab].
        self._forward_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in keep else {}
        # transformers >= 5.2x names the KV cache argument ``cache`` (``past_key_values`` before).
        self._cache_arg = "cache" if "cache" in keep else "past_key_values"
        adapters = root / "adapters"
        first = name = self.worlds[0]
        try:
            peft_model = PeftModel.from_pretrained(
                lm, str(adapters / first), adapter_name=first, is_trainable=False
            )
            for name in self.worlds[1:]:
                peft_model.load_adapter(str(adapters / name), adapter_name=name, is_trainable=False)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise PacEnsembleError(
                f"{adapters / name}: cannot load world {name!r} onto base model {self.base}: {exc}"
            ) from exc
        self.model = peft_model.to(self.device).eval()  # peft mixes adapters in eval mode only
        for p in self.model.parameters():
            p.requires_grad_(False)
        self._rows = [*self.worlds, BASE_ROW]
        self._stacked = self._stack() if batching == "stacked" else None
        tok = self.tokenizer
        eos = lm.generation_config.eos_token_id if lm.generation_config else None
        eos = eos if eos is not None else tok.eos_token_id
        self.eos_ids = frozenset(
            eos if isinstance(eos, list | tuple) else ([] if eos is None else [eos])
        )
        self.start_id = next(
            i
            for i in (tok.bos_token_id, *sorted(self.eos_ids), tok.pad_token_id, 0)
            if i is not None
        )
        ctx = getattr(lm.config, "max_position_embeddings", None)
        tmax = getattr(tok, "model_max_length", None)
        self.context = ctx or (tmax if tmax and tmax < 1_000_000 else None)
        self._lock = threading.Lock()
        log.info(
            "PAC ensemble loaded: m=%d worlds, base=%s, device=%s, dtype=%s, top_k=%d, "
            "batching=%s, in %.1f s (worlds are NOT private on their own: serve them only "
            "through the curator)",
            self.m,
            self.base,
            self.device,
            dtype,
            top_k,
            "peft" if self._stacked is None else "stacked",
            time.perf_counter() - start,
        )

    # -- model

    def _stack(self) -> Any:
        """The worlds' adapters stacked for one batched forward, or None (peft's mixed batch)."""
        from privcode.models.multi_lora import MultiLoraError, StackedLora

        try:
            return StackedLora(self.model, self._rows)
        except MultiLoraError as exc:
            log.warning("PAC ensemble: peft's (slower) mixed-adapter batch, because %s", exc)
            return None

    def _forward(self, rows: Any, repeat: int = 1, **kwargs: Any) -> Any:
        """One forward of ``repeat`` tiles of the ``m + 1`` rows (in each, row s: world s;
        row m: the public base)."""
        if self._stacked is None:
            return self.model(input_ids=rows, adapter_names=self._rows * repeat, **kwargs)
        with self._stacked.active(repeat=repeat):
            return self.model(input_ids=rows, **kwargs)

    def encode(self, prompt: str) -> list[int]:
        """Prompt token ids (special tokens as the tokenizer adds them; never empty)."""
        if not isinstance(prompt, str):
            raise PacEnsembleError(f"prompt must be a string, got {type(prompt).__name__}")
        ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return ids or [self.start_id]

    def step_logprobs(self, ids: Sequence[int], past: Any = None) -> tuple[StepLogprobs, Any]:
        """Next-token log-probs of all ``m + 1`` rows after ``ids``; returns them and the cache.

        ``past`` None: ``ids`` is the whole context (prefill). Otherwise
        ``ids`` are the tokens following the context cached in ``past``
        (normally one). The cache is extended IN PLACE and returned: pass it
        to the next call, never reuse an older one.
        """
        import torch

        ids = [int(i) for i in ids]
        if not ids:
            raise PacEnsembleError("step_logprobs needs at least one token id")
        rows = torch.tensor([ids] * (self.m + 1), dtype=torch.long, device=self.device)
        (step,), cache = self._cached_forward(rows, 1, past)
        return step, cache

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> list[tuple[StepLogprobs, Any]]:
        """The prefills of several prompts in ONE forward: for each, the ``(StepLogprobs,
        cache)`` its :meth:`step_logprobs` ``(ids)`` would give (to float rounding).

        Prompt g sits right-aligned after ``pad_g`` masked columns at positions 0..n_g - 1
        (the last column is every prompt's next-token position); its cache comes back cut
        to its own rows and columns (:func:`privcode.models.kv_batch.own_caches`), ready for
        :meth:`privcode.models.kv_batch.KvBatch.join`. Raises
        :class:`~privcode.models.kv_batch.KvBatchError` for caches that cannot be cut.
        """
        import torch

        from privcode.models.kv_batch import own_caches

        prompts = [[int(i) for i in ids] for ids in prompts]
        if not prompts or not all(prompts):
            raise PacEnsembleError("prefill_batch needs prompts of at least one token id")
        if len(prompts) == 1:
            return [self.step_logprobs(prompts[0])]
        k, rows, width = len(prompts), self.m + 1, max(map(len, prompts))
        pads = torch.tensor([width - len(p) for p in prompts]).repeat_interleave(rows)
        ids = [[self.start_id] * (width - len(p)) + p for p in prompts for _ in range(rows)]
        columns = torch.arange(width)[None, :]
        extra = {
            "attention_mask": (columns >= pads[:, None]).long().to(self.device),
            "position_ids": (columns - pads[:, None]).clamp(min=0).to(self.device),
        }
        rows_t = torch.tensor(ids, dtype=torch.long, device=self.device)
        steps, cache = self._cached_forward(rows_t, k, None, **extra)
        caches = own_caches(cache, rows, map(len, prompts))
        return list(zip(steps, caches, strict=True))

    def sequence_logprobs(self, ids: Sequence[int]) -> tuple[Any, Any]:
        """Log-probs after every prefix of ``ids`` in one pass: public ``[L, vocab]`` and
        worlds ``[m, L, vocab]`` (CPU float32 tensors; teacher forcing, no cache)."""
        import torch

        ids = [int(i) for i in ids]
        if not ids:
            raise PacEnsembleError("sequence_logprobs needs at least one token id")
        rows = torch.tensor([ids] * (self.m + 1), dtype=torch.long, device=self.device)
        with self._lock, torch.inference_mode():
            logits = self._forward(rows).logits
            lp = torch.log_softmax(logits.float(), dim=-1).cpu()
        return lp[self.m], lp[: self.m]

    # -- generation

    def generate(
        self, curator: Any, session_id: str, prompt: str, max_tokens: int, **options: Any
    ) -> PacCompletion:
        """A PAC-private completion of ``prompt`` in session ``session_id`` of ``curator``.

        Options (keyword only, :class:`~privcode.pac.decode.PacDecode`'s): ``decoder``:
        ``"greedy"`` or ``"gumbel"`` (coupled Gumbel at ``temperature``; ``seed`` seeds the
        public Gumbel draws, None = fresh); ``stop``: strings that end the completion (cut
        before the first one); ``on_exhausted``: with no budget for a private token,
        ``"fallback"`` emits the public model's token (free) and goes on, ``"stop"`` ends the
        completion there, releasing nothing more (``exhausted`` set, finish ``"length"``);
        ``sink`` (streaming): ``sink.put(token)`` gets each released token, and
        ``sink.cancelled`` (the client went away), checked before each step, ends it there
        (finish ``"length"``) before anything more is charged. One PacDecode step per forward
        (the PAC server runs many decodes through one forward, :meth:`step_batch`).
        """
        decode = self.decode(curator, session_id, prompt, max_tokens, **options)
        past = None
        while decode.live():
            lp, past = self.step_logprobs(decode.feed, past)
            decode.advance(lp)
        return decode.result()

    def decode(self, curator: Any, session_id: str, prompt: str, max_tokens: int, **options: Any):
        """The :class:`privcode.pac.decode.PacDecode` of a completion (:meth:`generate`'s
        arguments, validated; nothing computed yet): to step it yourself, or beside others."""
        from privcode.pac.decode import PacDecode

        return PacDecode(self, curator, session_id, prompt, max_tokens, **options)

    def step_batch(self, batch: Any, feeds: Sequence[int]) -> list[StepLogprobs]:
        """One forward of every decode in ``batch`` (a :class:`privcode.models.kv_batch.
        KvBatch` of groups of ``m + 1`` rows, each holding its prefill's cache, from
        :meth:`step_logprobs`), ``feeds[g]`` the next token of group ``g`` in the batch's
        order; each group's :class:`StepLogprobs`, as its solo :meth:`step_logprobs` would
        give them (to float rounding). The batch's cache is extended in place."""
        import torch

        k, rows = len(batch), self.m + 1
        if len(feeds) != k or batch.rows != k * rows:
            raise PacEnsembleError(f"step_batch: {len(feeds)} tokens for {k} groups")
        ids = torch.tensor([[int(t)] for t in feeds for _ in range(rows)], device=self.device)
        steps, _ = self._cached_forward(ids, k, batch.cache, **batch.forward_kwargs())
        batch.stepped()
        return steps

    def _cached_forward(
        self, rows: Any, k: int, past: Any, **extra: Any
    ) -> tuple[list[StepLogprobs], Any]:
        """One forward of ``k`` tiles over the KV cache ``past`` (None: a fresh one); each
        tile's :class:`StepLogprobs` and the cache (extended in place)."""
        import torch

        with self._lock, torch.inference_mode():
            out = self._forward(
                rows,
                repeat=k,
                use_cache=True,
                **{self._cache_arg: past},
                **extra,
                **self._forward_kwargs,
            )
            steps = self._steps(out.logits, k)
        cache = getattr(out, "cache", None)
        return steps, cache if cache is not None else out.past_key_values

    def _steps(self, logits: Any, k: int) -> list[StepLogprobs]:
        """Each of ``k`` tiles' :class:`StepLogprobs` from a forward's ``logits`` (last
        position): the rows' log-softmax at the public row's top-``top_k`` candidates."""
        import torch

        rows = self.m + 1
        lp = torch.log_softmax(logits[:, -1, :].float(), dim=-1).view(k, rows, -1)
        top = min(self.top_k, lp.shape[-1])
        candidates = torch.topk(lp[:, self.m], top).indices  # [k, top]
        chosen = torch.gather(lp, 2, candidates[:, None, :].expand(k, rows, top))
        chosen = chosen.double().cpu().numpy()
        candidates = candidates.cpu().numpy().astype(np.int64)
        return [
            StepLogprobs(
                candidates=candidates[g], worlds=chosen[g, : self.m], public=chosen[g, self.m]
            )
            for g in range(k)
        ]
