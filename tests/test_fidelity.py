"""Fidelity metrics (privcode.audit.fidelity): identical vs disjoint sets, closed forms, report."""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
import scipy.linalg

from privcode.audit.fidelity import (
    PLOT_NAME,
    REPORT_NAME,
    FidelityError,
    ast_features,
    ast_similarity,
    bleu4,
    centroid_cosine,
    code_tokens,
    fidelity_report,
    frechet_distance,
    nearest_neighbours,
)

_OPS = ["+", "-", "*", "//", "%", "**"]


def arithmetic(n: int) -> list[str]:
    """Small numeric functions, all distinct."""
    return [
        f"def calc_{i}(a, b):\n    x = a {_OPS[i % 6]} b\n    y = x * {i + 2} - a\n"
        f"    return y + {i}\n"
        for i in range(n)
    ]


def formatting(n: int) -> list[str]:
    """Small string-formatting classes, all distinct."""
    return [
        f"class Label{i}:\n    def __init__(self, name, tag='item{i}'):\n"
        f"        self.name = name\n        self.tag = tag\n\n"
        f"    def render(self):\n        text = '<{{}}:{{}}>'.format(self.tag, self.name)\n"
        f"        return text.upper() + ' / '.join(['title', 'caption{i}'])\n"
        for i in range(n)
    ]


def hashed_embedder(texts, dim: int = 64) -> np.ndarray:
    """Deterministic bag of word tokens hashed into ``dim`` buckets, L2-normalised."""
    out = np.zeros((len(texts), dim))
    for i, t in enumerate(texts):
        for tok in re.findall(r"\w+|[^\w\s]", t):
            out[i, zlib.crc32(tok.encode()) % dim] += 1.0
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def report(tmp_path, syn, priv, name, **kw):
    return fidelity_report(
        syn, priv, tmp_path / name, embedder=kw.pop("embedder", hashed_embedder), **kw
    )


# --------------------------------------------------------------------------- components


def test_code_tokens_split_python_and_fall_back():
    assert code_tokens("def f(x):\n    return x+1  # add one\n") == [
        "def",
        "f",
        "(",
        "x",
        ")",
        ":",
        "return",
        "x",
        "+",
        "1",
        "#",
        "add",
        "one",
    ]
    assert code_tokens("s = 'hello world'") == ["s", "=", "'", "hello", "world", "'"]
    assert code_tokens('x = """unterminated') == ["x", "=", '"', '"', '"', "unterminated"]


def test_bleu_identical_is_one_and_disjoint_low():
    codes = arithmetic(8)
    ident = bleu4(codes, codes)
    assert ident["sentence_mean"] == pytest.approx(1.0)
    assert ident["corpus"] == pytest.approx(1.0)
    far = bleu4(arithmetic(8), formatting(8))
    assert far["sentence_mean"] < 0.1 and far["corpus"] < 0.1
    with pytest.raises(FidelityError):
        bleu4(codes, codes[:3])


def test_ast_similarity_identical_disjoint_and_unparsable():
    a, b = arithmetic(6), formatting(6)
    assert ast_similarity(a, a)["mean"] == pytest.approx(1.0)
    far = ast_similarity(a, b)["mean"]
    assert 0.0 < far < 0.5
    res = ast_similarity([a[0], "def broken(:\n"], [a[0], a[1]])
    assert res["mean"] == pytest.approx(0.5)
    assert (res["unparsable_a"], res["unparsable_b"]) == (1, 0)
    assert ast_features("def broken(:") is None
    # Context nodes are ignored: same structure, different names -> 1.
    assert ast_similarity(["x = y"], ["a = b"])["mean"] == pytest.approx(1.0)


def test_nearest_neighbours_cosine():
    q = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    r = np.array([[0.0, 1.0], [3.0, 0.1]])
    idx, cos = nearest_neighbours(q, r)
    assert idx.tolist() == [1, 0, 1]
    assert cos[1] == pytest.approx(1.0)


# --------------------------------------------------------------------------- Frechet distance


def test_frechet_exact_in_one_dimension():
    rng = np.random.default_rng(1)
    a, b = rng.normal(2.0, 3.0, 500), rng.normal(-1.0, 0.5, 700)
    expected = (a.mean() - b.mean()) ** 2 + (a.std(ddof=1) - b.std(ddof=1)) ** 2
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)


def _analytic_fd(mu1, s1, mu2, s2) -> float:
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


def test_frechet_matches_gaussian_closed_form():
    rng = np.random.default_rng(7)
    d = 3
    ma, mb = rng.normal(size=(d, d)), rng.normal(size=(d, d))
    s1, s2 = ma @ ma.T + 0.5 * np.eye(d), mb @ mb.T + 0.2 * np.eye(d)
    mu1, mu2 = np.zeros(d), np.array([1.0, -0.5, 2.0])
    n = 100_000
    xa = rng.multivariate_normal(mu1, s1, size=n)
    xb = rng.multivariate_normal(mu2, s2, size=n)
    analytic = _analytic_fd(mu1, s1, mu2, s2)
    assert frechet_distance(xa, xb) == pytest.approx(analytic, rel=0.03)
    # Same sample statistics through scipy's sqrtm: the eigh route agrees to round-off.
    small_a, small_b = xa[:50], xb[:80]
    ref = _analytic_fd(
        small_a.mean(0),
        np.cov(small_a, rowvar=False),
        small_b.mean(0),
        np.cov(small_b, rowvar=False),
    )
    assert frechet_distance(small_a, small_b) == pytest.approx(ref, rel=1e-8)


def test_frechet_identical_and_singular_covariance():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 64))  # n < d: singular covariance
    scale = float(np.trace(np.cov(x, rowvar=False)))
    assert abs(frechet_distance(x, x)) < 1e-6 * scale
    assert frechet_distance(x, x + 1.0) == pytest.approx(64.0, rel=1e-6)
    assert frechet_distance(x[:1], x[:1]) == 0.0
    with pytest.raises(FidelityError):
        frechet_distance(x, x[:, :3])
    with pytest.raises(FidelityError):
        frechet_distance(np.full((3, 2), np.nan), x[:, :2])


def test_centroid_cosine():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert centroid_cosine(a, a) == pytest.approx(1.0)
    assert centroid_cosine(a, -a) == pytest.approx(-1.0)
    assert centroid_cosine(a, np.array([[1.0, -1.0]])) == pytest.approx(0.0, abs=1e-12)
    assert centroid_cosine(np.array([[1.0, 0], [-1.0, 0]]), a) == 0.0  # zero centroid


# --------------------------------------------------------------------------- the report


@pytest.mark.heavy
def test_report_identical_vs_half_vs_disjoint(tmp_path):
    priv = formatting(12)
    ident = report(tmp_path, priv, priv, "ident")
    half = report(tmp_path, formatting(6) + arithmetic(6), priv, "half")
    far = report(tmp_path, arithmetic(12), priv, "far")

    assert ident["bleu4"] == pytest.approx(1.0) and ident["bleu4_corpus"] == pytest.approx(1.0)
    assert ident["ast_similarity"] == pytest.approx(1.0)
    assert ident["centroid_cosine"] == pytest.approx(1.0)
    assert ident["nn_cosine_mean"] == pytest.approx(1.0)
    assert abs(ident["frechet"]) < 1e-9
    assert far["bleu4"] < 0.1
    for key in ("bleu4", "bleu4_corpus", "ast_similarity", "centroid_cosine", "nn_cosine_mean"):
        assert ident[key] > half[key] > far[key], key
    assert ident["frechet"] < half["frechet"] < far["frechet"]
    assert far["frechet"] > 0.1
    assert (ident["n_synthetic"], ident["n_private"]) == (12, 12)
    assert ident["unparsable_synthetic"] == ident["unparsable_private"] == 0


def test_report_holds_only_aggregates_and_writes_png(tmp_path):
    syn, priv = arithmetic(10) + ["def broken(:\n"], formatting(9) + ["while True\n"]
    res = report(tmp_path, syn, priv, "out")
    out = tmp_path / "out"
    png = (out / PLOT_NAME).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert res["plot"] == PLOT_NAME and res["projection"] == "tsne"
    assert (res["unparsable_synthetic"], res["unparsable_private"]) == (1, 1)
    codes = set(syn) | set(priv)
    for key, value in res.items():
        assert isinstance(value, int | float | str | type(None)), key
        if isinstance(value, str):
            assert len(value) <= 40 and value not in codes, key
    text = (out / REPORT_NAME).read_text()
    assert json.loads(text) == res
    assert not any(c.strip() in text for c in codes)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_report_subsamples_deterministically(tmp_path):
    syn, priv = arithmetic(30), formatting(25)
    a = report(tmp_path, syn, priv, "a", max_samples=8, seed=5, plot=False)
    b = report(tmp_path, syn, priv, "b", max_samples=8, seed=5, plot=False)
    assert a == b
    assert (a["n_synthetic"], a["n_private"]) == (8, 8)
    assert (a["n_synthetic_total"], a["n_private_total"]) == (30, 25)
    assert a["plot"] is None and not (tmp_path / "a" / PLOT_NAME).exists()


@pytest.mark.parametrize("n_syn,n_priv", [(1, 1), (1, 2), (2, 4)])
def test_report_tiny_sets(tmp_path, n_syn, n_priv):
    res = report(tmp_path, arithmetic(n_syn), formatting(n_priv), "tiny")
    assert res["projection"] == ("pca" if n_syn + n_priv < 5 else "tsne")
    assert (tmp_path / "tiny" / PLOT_NAME).exists()
    assert all(np.isfinite(res[k]) for k in ("bleu4", "frechet", "centroid_cosine"))


def test_report_rejects_bad_input(tmp_path):
    with pytest.raises(FidelityError, match="empty"):
        report(tmp_path, [], formatting(3), "x")
    with pytest.raises(FidelityError, match="empty"):
        report(tmp_path, arithmetic(3), [], "x")
    with pytest.raises(FidelityError, match=r"private_codes\[1\]"):
        report(tmp_path, arithmetic(3), ["x = 1", None], "x")
    with pytest.raises(FidelityError, match="rows"):
        report(tmp_path, arithmetic(3), formatting(3), "x", embedder=lambda texts: np.ones((1, 4)))
    with pytest.raises(FidelityError, match="max_samples"):
        report(tmp_path, arithmetic(3), formatting(3), "x", max_samples=0)


# --------------------------------------------------------------------------- the real embedder


@pytest.fixture(scope="module")
def minilm():
    from privcode.audit.fidelity import default_embedder

    return default_embedder()


def test_report_with_minilm_embedder(tmp_path, minilm):
    priv = formatting(10)
    ident = report(tmp_path, priv, priv, "ident", embedder=minilm)
    half = report(tmp_path, formatting(5) + arithmetic(5), priv, "half", embedder=minilm)
    far = report(tmp_path, arithmetic(10), priv, "far", embedder=minilm)
    assert ident["embedding_dim"] == 384
    assert ident["bleu4"] == pytest.approx(1.0) and ident["ast_similarity"] == pytest.approx(1.0)
    assert ident["centroid_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert ident["frechet"] < 1e-5
    assert ident["frechet"] < half["frechet"] < far["frechet"]
    assert ident["centroid_cosine"] > half["centroid_cosine"] > far["centroid_cosine"]
    assert far["bleu4"] < 0.1 and (tmp_path / "far" / PLOT_NAME).exists()


def test_minilm_embedder_reads_its_training_window_of_128_word_pieces(minilm):
    from privcode.audit.fidelity import FIDELITY_WINDOW

    head = "def f(x):\n" + "".join(f"    x = x + {i}\n" for i in range(60))  # > 128 pieces
    a, b, short = minilm(
        [head + "    return x\n", head + "    raise ValueError(x)\n", "def f(x):\n    return x\n"]
    )
    assert FIDELITY_WINDOW == 128
    assert np.allclose(a, b, atol=1e-6)  # they differ only after the window
    assert float(a @ short) < 0.99
    with pytest.raises(ValueError, match="max_seq_length"):
        from privcode.models.embedding import EmbeddingScorer

        EmbeddingScorer(max_seq_length=0)
