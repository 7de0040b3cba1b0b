"""Fidelity of the synthetic set D_syn to the private set (PrivCode++ App. C; docs/audits.md).

Runs inside the private boundary: :func:`fidelity_report` returns and writes aggregates only
(floats and counts, never a code string, an id or a per-record score). The t-SNE plot shows one
point per private record: for the data owner, never released with the DP artifact.
Each synthetic snippet s_i is paired with its nearest private neighbour
``nn(i) = argmax_j cos(e(s_i), e(p_j))`` (first index on ties). Over the n pairs: BLEU-4
(sacrebleu on :mod:`tokenize` tokens, [0, 1] scale; ``bleu4`` the mean sentence BLEU,
``bleu4_corpus``) and AST similarity, the weighted Jaccard
``sum_k min(F_a[k], F_b[k]) / sum_k max(F_a[k], F_b[k])`` of node / edge / path feature
multisets (0 with an unparsable side). Over the two clouds: :func:`frechet_distance` and
:func:`centroid_cosine`. Embeddings: all-MiniLM-L6-v2
(:class:`privcode.models.embedding.EmbeddingScorer`) or any ``texts -> (n, d) array``
``embedder``. Design notes: docs/audits.md, "privcode/audit/fidelity.py".
"""

from __future__ import annotations

import ast
import io
import math
import re
import tokenize as pytokenize
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from privcode.errors import PrivcodeError
from privcode.models.embedding import EmbeddingScorer
from privcode.utils import atomic_path, atomic_write_json

__all__ = [
    "Embedder",
    "FidelityError",
    "PLOT_NAME",
    "REPORT_NAME",
    "ast_features",
    "ast_similarity",
    "bleu4",
    "centroid_cosine",
    "code_tokens",
    "default_embedder",
    "fidelity_report",
    "frechet_distance",
    "nearest_neighbours",
    "read_private_codes",
    "read_synthetic_codes",
]

#: A code embedder: ``embedder(texts)`` -> array of shape ``(len(texts), d)``.
Embedder = Callable[[Sequence[str]], Any]

PLOT_NAME = "fidelity_tsne.png"
_OPENMP_MIN_POINTS = 1000  # below: single-threaded t-SNE (thread start-up costs more)
REPORT_NAME = "fidelity.json"

_WORDS = re.compile(r"\w+|[^\w\s]")
_SKIP_TOKENS = {
    pytokenize.NEWLINE,
    pytokenize.NL,
    pytokenize.INDENT,
    pytokenize.DEDENT,
    pytokenize.ENDMARKER,
    pytokenize.ENCODING,
}
_SPLIT_TOKENS = {pytokenize.STRING, pytokenize.COMMENT}
for _name in ("FSTRING_MIDDLE", "TSTRING_MIDDLE"):  # 3.12+: f-string text is its own token
    if hasattr(pytokenize, _name):
        _SPLIT_TOKENS.add(getattr(pytokenize, _name))


class FidelityError(PrivcodeError, ValueError):
    """Fidelity inputs are unusable (empty set, non-string code, bad embeddings)."""


# --------------------------------------------------------------------------- inputs


def _check_codes(codes: Sequence[str], what: str) -> list[str]:
    if isinstance(codes, str):
        raise FidelityError(f"{what} must be a sequence of code strings, not one string")
    out = list(codes)
    if not out:
        raise FidelityError(f"{what} is empty: fidelity needs at least one snippet on each side")
    for i, c in enumerate(out):
        if not isinstance(c, str):
            raise FidelityError(f"{what}[{i}] is {type(c).__name__}, expected str")
    return out


def _as_matrix(emb: Any, what: str) -> np.ndarray:
    """(n, d) float64; a 1-D array is n samples of dimension 1."""
    x = np.asarray(emb, dtype=np.float64)
    if x.ndim == 1:
        x = x[:, None]
    if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
        raise FidelityError(f"{what}: expected a non-empty (n, d) array, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise FidelityError(f"{what}: embeddings contain NaN or infinity")
    return x


def read_synthetic_codes(path: str | Path) -> list[str]:
    """The ``code`` column of a Stage II ``synthetic.parquet``."""
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["code"])
    return [c if isinstance(c, str) else "" for c in table.column("code").to_pylist()]


def read_private_codes(path: str | Path) -> list[str]:
    """The code of every validated record of a private ``.parquet`` / ``.jsonl`` file."""
    from privcode.data.records import read_records

    return [r.code for r in read_records(path)]


# --------------------------------------------------------------------------- embeddings


#: Word pieces of code the default embedder reads: MiniLM's training window. Code is
#: long; at 256 (MiniLM's default) 200 snippets took 17 s on one core, at 128 about half.
FIDELITY_WINDOW = 128


def default_embedder() -> Embedder:
    """The offline MiniLM of the round-trip filter (unit-norm rows, lazy load), reading the
    first :data:`FIDELITY_WINDOW` word pieces of each snippet."""

    return EmbeddingScorer(max_seq_length=FIDELITY_WINDOW).embed


def _unit(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def nearest_neighbours(
    emb_query: Any, emb_ref: Any, chunk: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """For each query row, the index of the reference row of highest cosine, and that cosine.

    Rows are L2-normalised first (a zero row has cosine 0 with everything);
    ties go to the lowest index. Computed in chunks of ``chunk`` query rows.
    """
    q, r = _unit(_as_matrix(emb_query, "query")), _unit(_as_matrix(emb_ref, "reference"))
    if q.shape[1] != r.shape[1]:
        raise FidelityError(f"embedding dims differ: {q.shape[1]} vs {r.shape[1]}")
    idx = np.empty(len(q), dtype=np.int64)
    cos = np.empty(len(q), dtype=np.float64)
    for start in range(0, len(q), chunk):
        sims = q[start : start + chunk] @ r.T
        best = sims.argmax(axis=1)
        idx[start : start + chunk] = best
        cos[start : start + chunk] = sims[np.arange(len(best)), best]
    return idx, np.clip(cos, -1.0, 1.0)


# --------------------------------------------------------------------------- BLEU-4


def code_tokens(code: str) -> list[str]:
    """Python tokens of ``code`` for BLEU (see the module docstring). Never raises."""
    out: list[str] = []
    try:
        for tok in pytokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type in _SKIP_TOKENS:
                continue
            if tok.type in _SPLIT_TOKENS:
                out.extend(_WORDS.findall(tok.string))
            elif tok.string.strip():
                out.append(tok.string.strip())
        return out
    except (pytokenize.TokenError, SyntaxError, ValueError, RecursionError, MemoryError):
        return _WORDS.findall(code)


def _bleu_text(code: str) -> str:
    return " ".join(code_tokens(code))


def bleu4(synthetic_codes: Sequence[str], reference_codes: Sequence[str]) -> dict[str, float]:
    """BLEU-4 of aligned pairs on the [0, 1] scale: ``{"sentence_mean", "corpus"}``.

    ``synthetic_codes[i]`` is the hypothesis and ``reference_codes[i]`` its
    single reference (the caller pairs them; :func:`fidelity_report` uses
    nearest neighbours). ``sentence_mean`` = mean over pairs of sacrebleu's
    sentence BLEU (exp smoothing, effective order); ``corpus`` = corpus
    BLEU over all pairs (n-gram counts pooled, one brevity penalty).
    """
    from sacrebleu.metrics import BLEU

    hyps = [_bleu_text(c) for c in _check_codes(synthetic_codes, "synthetic_codes")]
    refs = [_bleu_text(c) for c in _check_codes(reference_codes, "reference_codes")]
    if len(hyps) != len(refs):
        raise FidelityError(f"bleu4 needs aligned pairs, got {len(hyps)} and {len(refs)}")
    sent = BLEU(tokenize="none", effective_order=True)
    scores = [
        sent.sentence_score(h, [r]).score if h and r else 0.0
        for h, r in zip(hyps, refs, strict=True)
    ]
    corpus = BLEU(tokenize="none").corpus_score(hyps, [refs]).score
    return {"sentence_mean": float(np.mean(scores)) / 100.0, "corpus": float(corpus) / 100.0}


# --------------------------------------------------------------------------- AST similarity


def ast_features(code: str) -> Counter | None:
    """Multiset of node types, parent->child edges and 3-node paths; None if unparsable."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    feats: Counter = Counter()
    stack: list[tuple[ast.AST, str, str]] = [(tree, "", "")]
    while stack:
        node, parent, grand = stack.pop()
        kind = type(node).__name__
        feats[(kind,)] += 1
        if parent:
            feats[(parent, kind)] += 1
            if grand:
                feats[(grand, parent, kind)] += 1
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.expr_context):
                stack.append((child, kind, parent))
    return feats


def _ruzicka(a: Counter, b: Counter) -> float:
    keys = a.keys() | b.keys()
    hi = sum(max(a[k], b[k]) for k in keys)
    return sum(min(a[k], b[k]) for k in keys) / hi if hi else 1.0


def ast_similarity(a_codes: Sequence[str], b_codes: Sequence[str]) -> dict[str, float | int]:
    """Mean weighted-Jaccard AST similarity of aligned pairs ``(a[i], b[i])``.

    Returns ``{"mean", "unparsable_a", "unparsable_b"}``; a pair with an
    unparsable side scores 0. Features are cached per distinct snippet.
    """
    a = _check_codes(a_codes, "a_codes")
    b = _check_codes(b_codes, "b_codes")
    if len(a) != len(b):
        raise FidelityError(f"ast_similarity needs aligned pairs, got {len(a)} and {len(b)}")
    cache: dict[str, Counter | None] = {}

    def feats(code: str) -> Counter | None:
        if code not in cache:
            cache[code] = ast_features(code)
        return cache[code]

    fa, fb = [feats(c) for c in a], [feats(c) for c in b]
    sims = [
        _ruzicka(x, y) if x is not None and y is not None else 0.0
        for x, y in zip(fa, fb, strict=True)
    ]
    return {
        "mean": float(np.mean(sims)),
        "unparsable_a": sum(x is None for x in fa),
        "unparsable_b": sum(y is None for y in fb),
    }


# --------------------------------------------------------------------------- distribution metrics


def _cov(x: np.ndarray) -> np.ndarray:
    """Unbiased sample covariance (ddof=1); zeros for a single sample."""
    if len(x) < 2:
        return np.zeros((x.shape[1], x.shape[1]))
    return np.atleast_2d(np.cov(x, rowvar=False))


def frechet_distance(emb_a: Any, emb_b: Any) -> float:
    """Frechet (2-Wasserstein) distance of Gaussians fitted to two embedding clouds.

    ``FD = ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^{1/2})``, sample means and unbiased
    covariances (ddof=1; one sample: 0); rows are samples, a 1-D array n samples of dimension 1.
    ``Tr (S_a S_b)^{1/2} = sum_i sqrt(lambda_i)`` over the eigenvalues (``eigh``, negatives
    clipped to 0) of the symmetric PSD ``S_a^{1/2} S_b S_a^{1/2}``, similar to ``S_a S_b``; the
    result is clipped at 0. Design notes: docs/audits.md, "privcode/audit/fidelity.py".
    """
    a, b = _as_matrix(emb_a, "emb_a"), _as_matrix(emb_b, "emb_b")
    if a.shape[1] != b.shape[1]:
        raise FidelityError(f"embedding dims differ: {a.shape[1]} vs {b.shape[1]}")
    diff = a.mean(axis=0) - b.mean(axis=0)
    sa, sb = _cov(a), _cov(b)
    w, v = np.linalg.eigh((sa + sa.T) / 2)
    sa_half = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T
    m = sa_half @ sb @ sa_half
    lam = np.linalg.eigvalsh((m + m.T) / 2)
    tr_sqrt = float(np.sqrt(np.clip(lam, 0.0, None)).sum())
    fd = float(diff @ diff) + float(np.trace(sa) + np.trace(sb)) - 2.0 * tr_sqrt
    return max(fd, 0.0)


def centroid_cosine(emb_a: Any, emb_b: Any) -> float:
    """``cos(mean(a), mean(b))`` in [-1, 1]; 0.0 when a centroid is the zero vector."""
    a, b = _as_matrix(emb_a, "emb_a"), _as_matrix(emb_b, "emb_b")
    if a.shape[1] != b.shape[1]:
        raise FidelityError(f"embedding dims differ: {a.shape[1]} vs {b.shape[1]}")
    ca, cb = a.mean(axis=0), b.mean(axis=0)
    na, nb = float(np.linalg.norm(ca)), float(np.linalg.norm(cb))
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.clip(ca @ cb / (na * nb), -1.0, 1.0))


# --------------------------------------------------------------------------- t-SNE plot


def _project_2d(x: np.ndarray, seed: int) -> tuple[np.ndarray, str]:
    """2-D coordinates: t-SNE for >= 5 points, else PCA (t-SNE needs perplexity < n).

    Perplexity = min(30, (n - 1) / 3), floored at 1. Inputs wider than 50
    dims are first reduced to 50 by PCA (the usual t-SNE preprocessing).
    Cost: ~1 minute for 4,000 points on one busy CPU core.
    """
    from sklearn.decomposition import PCA
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    n = len(x)
    if x.shape[1] < 2:
        x = np.hstack([x, np.zeros((n, 2 - x.shape[1]))])
    if n < 5:
        k = min(2, n)
        out = np.zeros((n, 2))
        if n > 1:
            out[:, :k] = PCA(n_components=k, random_state=seed).fit_transform(x)
        return out, "pca"
    if x.shape[1] > 50 and n > 50:
        x = PCA(n_components=50, random_state=seed).fit_transform(x)
    perplexity = max(min(30.0, (n - 1) / 3.0), 1.0)
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed)
    # t-SNE's matrix products are tiny: BLAS threads only spin (seconds lost on a busy
    # machine). OpenMP helps the Barnes-Hut gradient only for large n.
    with (
        threadpool_limits(1, user_api="blas"),
        threadpool_limits(1 if n < _OPENMP_MIN_POINTS else None, user_api="openmp"),
    ):
        return tsne.fit_transform(x.astype(np.float32)), "tsne"


def _plot(coords: np.ndarray, n_syn: int, n_priv: int, method: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    for rows, colour, label in (
        (coords[n_syn:], "#4a7ab5", f"private (n={n_priv})"),
        (coords[:n_syn], "#e07b39", f"synthetic (n={n_syn})"),
    ):
        ax.scatter(rows[:, 0], rows[:, 1], s=7, alpha=0.55, c=colour, label=label, linewidths=0)
    ax.set_title(
        f"{'t-SNE' if method == 'tsne' else 'PCA'} of code embeddings: "
        f"synthetic (n={n_syn}) vs private (n={n_priv})",
        fontsize=10,
    )
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="best", markerscale=2, fontsize=9)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- report


def _subsample(codes: list[str], k: int, rng: np.random.Generator) -> list[str]:
    if len(codes) <= k:
        return codes
    keep = np.sort(rng.choice(len(codes), size=k, replace=False))
    return [codes[i] for i in keep]


def _embed(embedder: Embedder, codes: list[str], what: str) -> np.ndarray:
    try:
        emb = _as_matrix(embedder(codes), f"{what} embeddings")
    except FidelityError:
        raise
    except Exception as exc:  # the embedder is user-supplied: name it in the error
        raise FidelityError(f"embedding the {what} code failed: {exc}") from exc
    if len(emb) != len(codes):
        raise FidelityError(f"{what}: the embedder returned {len(emb)} rows for {len(codes)} texts")
    return emb


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


def fidelity_report(
    synthetic_codes: Sequence[str],
    private_codes: Sequence[str],
    out_dir: str | Path,
    *,
    max_samples: int = 2000,
    seed: int = 0,
    embedder: Embedder | None = None,
    plot: bool = True,
) -> dict[str, Any]:
    """Fidelity aggregates of D_syn vs the private set, plus a t-SNE plot (Figure 3).

    Runs inside the private boundary. Each side is subsampled without replacement to
    ``max_samples`` (seeded by ``seed``), embedded with ``embedder`` (default:
    :func:`default_embedder`) and paired as in the module docstring. Writes atomically into
    ``out_dir`` :data:`REPORT_NAME` (the returned dict as JSON) and, if ``plot``,
    :data:`PLOT_NAME` (one point per sampled private record: data owner only, never released).
    Returns only numbers, counts and short labels (the keys: docs/audits.md,
    "privcode/audit/fidelity.py"). Raises :class:`FidelityError` for an empty side, non-string
    code or unusable embeddings.
    """
    syn_all = _check_codes(synthetic_codes, "synthetic_codes")
    priv_all = _check_codes(private_codes, "private_codes")
    if int(max_samples) < 1:
        raise FidelityError(f"max_samples must be >= 1, got {max_samples}")
    rng = np.random.default_rng(seed)
    syn = _subsample(syn_all, int(max_samples), rng)
    priv = _subsample(priv_all, int(max_samples), rng)

    embed = embedder if embedder is not None else default_embedder()
    e_syn, e_priv = _embed(embed, syn, "synthetic"), _embed(embed, priv, "private")
    if e_syn.shape[1] != e_priv.shape[1]:
        raise FidelityError(f"embedding dims differ: {e_syn.shape[1]} vs {e_priv.shape[1]}")

    nn, nn_cos = nearest_neighbours(e_syn, e_priv)
    paired = [priv[j] for j in nn]
    bleu = bleu4(syn, paired)
    ast_sim = ast_similarity(syn, paired)
    unparsable_priv = sum(ast_features(c) is None for c in priv)

    report: dict[str, Any] = {
        "bleu4": _finite(bleu["sentence_mean"]),
        "bleu4_corpus": _finite(bleu["corpus"]),
        "ast_similarity": _finite(ast_sim["mean"]),
        "nn_cosine_mean": _finite(float(nn_cos.mean())),
        "frechet": _finite(frechet_distance(e_syn, e_priv)),
        "centroid_cosine": _finite(centroid_cosine(e_syn, e_priv)),
        "n_synthetic": len(syn),
        "n_private": len(priv),
        "n_synthetic_total": len(syn_all),
        "n_private_total": len(priv_all),
        "unparsable_synthetic": int(ast_sim["unparsable_a"]),
        "unparsable_private": int(unparsable_priv),
        "embedding_dim": int(e_syn.shape[1]),
        "pairing": "nearest-private-by-embedding-cosine",
        "max_samples": int(max_samples),
        "seed": int(seed),
        "projection": None,
        "plot": None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plot:
        coords, method = _project_2d(np.vstack([e_syn, e_priv]), seed)
        _plot(coords, len(syn), len(priv), method, out / PLOT_NAME)
        report["projection"], report["plot"] = method, PLOT_NAME
    atomic_write_json(out / REPORT_NAME, report)
    return report
