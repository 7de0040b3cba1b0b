"""Stage II operators: the callable classes Ray Data runs in actor pools.

Each is constructed once per actor (loading its model or sandbox pool) and
called on batches (``dict`` of numpy arrays, one row per sample). They only
ever see the released DP artifact, public resources and the rows produced
upstream; none of them can name a private file.

Row columns, in the order they are filled:

* ``index`` (int): sample number i in [0, num_samples); ``z_seed``: the
  seed the latent of sample i is drawn from (``[seed, i]``);
* :class:`Generate`: ``code`` (the junior's continuation, cut to its longest
  compiling prefix of lines unless ``trim`` is off), ``cond_prompt``
  (the public prompt it was conditioned on, '' otherwise);
* :class:`Extract`: ``prompt`` (the instruction M_ext(code); for
  prompt-conditioned methods the public conditioning prompt itself);
* :class:`ExecutionFilter`: ``exec_status``, ``exec_passed``, ``exec_seconds``,
  ``exec_error``, ``exec_isolation`` (verdict of running the code in the sandbox, and the
  isolation it ran under);
* :class:`RoundTripScore`: ``roundtrip_score`` (NaN when the code did not
  pass execution: not scored) and ``roundtrip_passed``.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import math
import os
import textwrap
from typing import Any

import numpy as np

from privcode.sandbox import SandboxLimits, Verdict
from privcode.sandbox.executor import open_sandbox
from privcode.synth.extract import make_extractor
from privcode.synth.roundtrip import RoundTripFilter

log = logging.getLogger("privcode.synth")

__all__ = [
    "Extract",
    "ExecutionFilter",
    "Generate",
    "RoundTripScore",
    "latent_for",
    "trim_to_compilable",
]


def trim_to_compilable(text: str) -> str:
    """Dedent, then keep the longest prefix of whole lines that compiles (``text`` if none).

    ``compile`` parses and byte-compiles only: nothing in the snippet runs.
    """

    lines = textwrap.dedent(text).split("\n")
    for end in range(len(lines), 0, -1):
        candidate = "\n".join(lines[:end]).rstrip()
        if not candidate.strip():
            break
        try:
            compile(candidate + "\n", "<synthetic>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            continue
        return candidate + "\n"
    return text


def latent_for(seed: int, index: int, dz: int) -> np.ndarray:
    """z_i ~ N(0, I_dz), a function of (seed, i) only: reruns and resumed shards agree."""
    return np.random.default_rng([int(seed), int(index)]).standard_normal(dz).astype(np.float32)


def _counter(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> Any:
    try:
        from ray.util.metrics import Counter

        return Counter(name, description=description, tag_keys=tag_keys or None)
    except Exception:  # noqa: BLE001 - metrics are best effort outside a Ray worker
        return None


def _inc(counter: Any, value: float) -> None:
    if counter is not None and value:
        counter.inc(value)


def _return_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS (glibc ``malloc_trim``; elsewhere nothing).

    The round trip's encoder allocates activations of a new shape for every length-sorted
    batch; without this its actor's RSS crept up by fragments over a 50,000-sample run.
    """
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def _llm_device_dtype(llm: dict[str, Any]) -> tuple[str, Any]:
    """(device, torch dtype) of an LLM-filter actor: its GPU when it was given one
    (``llm["gpu"]``; an error naming ``llm["key"]`` when none is visible), else the CPU."""
    from privcode.models.placement import placement

    where = placement(bool(llm.get("gpu")), str(llm.get("dtype", "auto")), str(llm["key"]))
    return str(where.device), where.dtype


class Generate:
    """The junior samples code: from z_i through D (latent), a public prompt, or nothing."""

    def __init__(self, release_path: str, options: dict[str, Any], public_prompts: list[str]):
        import torch

        from privcode.models.junior import load_release
        from privcode.models.placement import placement

        # The actor's own GPU (synth.gpus_per_generator > 0), never a silent CPU fallback.
        where = placement(
            bool(options.get("gpu")), options.get("dtype", "auto"), "synth.gpus_per_generator"
        )
        if not where.cuda:
            torch.set_num_threads(1)
        self.release = load_release(release_path, device=where.device, dtype=where.dtype)
        self.placement = where.describe()
        self.opts = options
        self.prompts = public_prompts
        self.counter = _counter("privcode_synth_generated", "Samples generated by Stage II.")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        idx = [int(i) for i in batch["index"]]
        o, r = self.opts, self.release
        common = {
            "max_new_tokens": o["max_new_tokens"],
            "temperature": o["temperature"],
            "top_p": o["top_p"],
            "seed": (o["seed"] * 1_000_003 + idx[0]) % (1 << 62),
            "start": o.get("start_text", ""),
        }
        cond = [""] * len(idx)
        if r.conditioning == "latent":
            z = torch.from_numpy(np.stack([latent_for(o["seed"], i, r.dz) for i in idx]))
            codes = r.generate(z=z, **common)
        elif r.conditioning == "prompt":
            cond = [self.prompts[i % len(self.prompts)] for i in idx]
            codes = r.generate(prompts=cond, **common)
        else:
            codes = r.generate(n=len(idx), **common)
        _inc(self.counter, len(idx))
        if o.get("trim", True):
            codes = [trim_to_compilable(c) for c in codes]
        return {
            **batch,
            "code": np.array(codes, dtype=object),
            "cond_prompt": np.array(cond, dtype=object),
        }


class Extract:
    """M_ext(code) -> instruction (registry: privcode.synth.extract)."""

    def __init__(self, name: str, options: dict[str, Any], llm: dict[str, Any] | None = None):

        if name == "hf" and llm is not None:  # the HF model on this actor's GPU (or CPU)
            device, dtype = _llm_device_dtype(llm)
            options = {**options, "device": device, "dtype": dtype}
        self.extractor = make_extractor(name, **options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        codes = [str(c) for c in batch["code"]]
        extracted = self.extractor.extract(codes)
        # Prompt-conditioned methods already have their (public) instruction.
        prompts = [c if c else e for c, e in zip(batch["cond_prompt"], extracted, strict=True)]
        return {**batch, "prompt": np.array(prompts, dtype=object)}


class ExecutionFilter:
    """Runs every snippet in the sandbox; keeps the verdict (never the snippet's output)."""

    def __init__(
        self,
        limits: dict[str, Any],
        workers: int,
        isolation: str = "full",
        executor: str = "",
        parse_check: tuple[str, ...] = (),
    ):

        self.parse_check = tuple(parse_check)
        self.pool = open_sandbox(
            workers, SandboxLimits(**limits), isolation=isolation, executor=executor
        )
        self.removed = _counter(
            "privcode_synth_exec_removed", "Samples removed by the execution filter."
        )
        self.verdicts = _counter(
            "privcode_sandbox_verdicts",
            "Sandbox verdicts of Stage II snippets, by status.",
            ("status",),
        )

    def _parse_checked(self, code: str) -> str | None:
        """The language ``code`` parses in, when it is not Python (None: execute it)."""
        if not self.parse_check:
            return None
        from privcode.data.ingest.syntax import parses

        if parses(code, "python"):
            return None
        return next((lang for lang in self.parse_check if parses(code, lang)), None)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:

        codes = [str(c) for c in batch["code"]]
        parsed = [self._parse_checked(c) for c in codes]
        run = [c for c, lang in zip(codes, parsed, strict=True) if lang is None]
        ran = iter(self.pool.map(run) if run else [])
        verdicts = [
            next(ran)
            if lang is None
            else Verdict(True, f"parsed:{lang}", 0.0, None, "", "", "parse-check", None)
            for lang in parsed
        ]
        passed = np.array([v.passed for v in verdicts], dtype=bool)
        _inc(self.removed, int((~passed).sum()))
        if self.verdicts is not None:
            for status, count in collections.Counter(v.status for v in verdicts).items():
                self.verdicts.inc(count, tags={"status": status})
        return {
            **batch,
            "exec_status": np.array([v.status for v in verdicts], dtype=object),
            "exec_passed": passed,
            "exec_seconds": np.array([round(v.seconds, 4) for v in verdicts]),
            "exec_error": np.array(
                [getattr(v, "error", None) or "" for v in verdicts], dtype=object
            ),
            "exec_isolation": np.array([v.isolation for v in verdicts], dtype=object),
        }


class RoundTripScore:
    """sim(M_r(code), prompt) for the rows that passed execution (the others are not scored)."""

    def __init__(
        self,
        summarizer: str,
        scorer: str,
        threshold: float,
        options: dict[str, Any],
        llm: dict[str, Any] | None = None,
        threads: int = 1,
    ):
        import torch

        # As many torch threads as the actor has CPUs: torch's default (every core of the
        # node) makes a 0.2-CPU actor fight the generators and sandboxes for all of them.
        torch.set_num_threads(max(1, int(threads)))
        # oneDNN keeps up to 1,024 compiled kernels, one per batch shape, with their buffers;
        # the length-sorted batches have many shapes. 16 kept the actor's RSS growth over
        # 20,000 pairs at 70 MiB instead of 115, at the same speed (read at first use).
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

        kwargs = dict(options)
        if llm is not None and (summarizer == "hf" or scorer == "bertscore"):
            device, dtype = _llm_device_dtype(llm)  # every model of this actor on its device
            if summarizer == "hf":
                kwargs.update(summarizer_device=device, summarizer_dtype=dtype)
            kwargs["scorer_device"] = device
            if scorer == "bertscore":
                kwargs["scorer_dtype"] = dtype
        if threshold >= 0:
            kwargs["threshold"] = threshold
        # summarizer=vllm: the summaries arrive in the ``summary`` column (a Ray Data LLM
        # stage upstream, privcode.synth.llm_stages); this actor only scores.
        self.from_column = summarizer == "vllm"
        if self.from_column:
            summarizer = "offline"  # never called
        self.filter = RoundTripFilter(summarizer=summarizer, scorer=scorer, **kwargs)
        self.threshold = float(self.filter.threshold)
        self.removed = _counter(
            "privcode_synth_roundtrip_removed", "Samples removed by the round-trip filter."
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = np.asarray(batch["exec_passed"], dtype=bool)
        scores = np.full(len(ok), math.nan)
        rows = np.flatnonzero(ok)
        if len(rows):
            got = self.filter.score(
                [str(batch["prompt"][i]) for i in rows],
                [str(batch["code"][i]) for i in rows],
                [str(batch["summary"][i]) for i in rows] if self.from_column else None,
            )
            scores[rows] = np.asarray(got, dtype=float)
        passed = ok & (np.nan_to_num(scores, nan=-math.inf) >= self.threshold)
        _inc(self.removed, int(ok.sum() - passed.sum()))
        _return_freed_memory()
        return {**batch, "roundtrip_score": scores, "roundtrip_passed": passed}
