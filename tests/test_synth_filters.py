"""Stage II filters: prompt extraction, the round-trip filter and deduplication.

Offline pieces are checked against exact expected outputs; the HF pieces run
on the session's tiny ``ci`` base model (gibberish output: shapes,
determinism and caps only). The embedding model is the bundled MiniLM,
loaded once per module.
"""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch
from gates import REQUIRE_SANDBOX, require_or_skip

from privcode.config import BaseConfig
from privcode.data.public import public_pairs
from privcode.models.base import build_base
from privcode.models.embedding import EmbeddingScorer, default_embedding_model
from privcode.synth.dedup import Deduplicator, _shingle_hashes, normalize_code
from privcode.synth.extract import (
    EXTRACTORS,
    MAX_INSTRUCTION_CHARS,
    HFExtractor,
    OfflineExtractor,
    make_extractor,
)
from privcode.synth.roundtrip import (
    DEFAULT_THRESHOLDS,
    BERTScoreScorer,
    OfflineSummarizer,
    RoundTripFilter,
    make_scorer,
    make_summarizer,
)


@pytest.fixture(scope="module")
def ci_path(ci_base_cache) -> str:
    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


@pytest.fixture(scope="module")
def embedding() -> EmbeddingScorer:
    return EmbeddingScorer()


# --------------------------------------------------------------------------- extraction

ADD = '''def add(a: int, b: int) -> int:
    """Return the sum of a and b.

    Both arguments are integers.
    """
    return a + b
'''
PARSE = """def parse_header(line):
    key, value = line.split(":", 1)
    return key.strip(), value.strip()
"""
STACK = '''class Stack(list):
    """A simple LIFO stack."""

    def push(self, item):
        self.append(item)

    def peek(self):
        return self[-1]
'''

EXPECTED = [
    (ADD, "Write a Python function `add(a: int, b: int) -> int` that returns the sum of a and b."),
    (
        PARSE,
        "Write a Python function `parse_header(line)` that parses header. "
        "It uses `split` and `strip`.",
    ),
    (
        "def is_prime(n):\n    for d in range(2, n):\n        if n % d == 0:\n            return False\n"
        "    return True\n",
        "Write a Python function `is_prime(n)` that returns whether it is prime. It uses `range`.",
    ),
    (
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "Write a Python function `fib(n)` that implements fib. It calls itself recursively.",
    ),
    (
        "def fib(n):\n    '''The n-th Fibonacci number.'''\n    return n\n",
        "Write a Python function `fib(n)`. The n-th Fibonacci number.",
    ),
    (
        "async def fetch_all(urls):\n    out = []\n    for u in urls:\n        out.append(await get(u))\n"
        "    return out\n",
        "Write an async Python function `fetch_all(urls)` that fetches all. "
        "It uses `append` and `get` and returns `out`.",
    ),
    (STACK, "Write a Python class `Stack(list)` with methods `push`, `peek`. A simple LIFO stack."),
    ("def broken(:\n    pass\n", "Complete the following Python code: def broken(:"),
    ("", "Write a Python script."),
    ("print(sum([1, 2]))\n", "Write a Python script that uses `print` and `sum`."),
]


def test_offline_extractor_exact_instructions():
    codes = [c for c, _ in EXPECTED]
    assert OfflineExtractor().extract(codes) == [e for _, e in EXPECTED]
    assert OfflineExtractor().extract([]) == []


def test_offline_extractor_never_executes_or_raises(tmp_path):
    marker = tmp_path / "pwned"
    hostile = [
        f"__import__('os').system('touch {marker}')\n",
        f"def f(x=__import__('os').system('touch {marker}')):\n    return x\n",
        f"class A:\n    open({str(marker)!r}, 'w').write('x')\n",
        "x = " + "(" * 500 + ")" * 500,
        "x = " + "+".join(["1"] * 100_000),
        "\x00\x01 def \x7f",
        "def f("
        + ", ".join(f"a{i}=1" for i in range(200))
        + "):\n    '''"
        + "word " * 500
        + "'''\n",
        "\ud800 surrogate",
        "'''unterminated",
    ]
    out = OfflineExtractor().extract(hostile)
    assert not marker.exists()
    assert len(out) == len(hostile)
    assert all(isinstance(s, str) and 0 < len(s) <= MAX_INSTRUCTION_CHARS for s in out)
    assert out[0] == "Write a Python script that uses `system` and `__import__`."
    assert (
        out[1]
        == "Write a Python function `f(x=__import__('os').system('touch "
        + str(marker)
        + "'))` that implements f. It returns `x`."
    )
    assert out[6].startswith("Write a Python function `f(...)`. word word") and out[6].endswith(
        "..."
    )
    assert OfflineExtractor(max_chars=40).extract([ADD])[0].endswith("...")
    assert len(OfflineExtractor(max_chars=40).extract([ADD])[0]) <= 40


def test_extractor_registry():
    assert set(EXTRACTORS) == {"offline", "hf", "endpoint"}
    assert isinstance(make_extractor("offline"), OfflineExtractor)
    assert isinstance(make_extractor("hf", model="/nonexistent/model"), HFExtractor)  # lazy
    with pytest.raises(ValueError, match="known: endpoint, hf, offline"):
        make_extractor("gpt")
    with pytest.raises(ValueError, match="bad options"):
        make_extractor("offline", temperature=0.1)
    with pytest.raises(ValueError):
        OfflineExtractor(max_chars=1000)


def test_hf_extractor_tiny_model(ci_path):
    ex = make_extractor("hf", model=ci_path, max_new_tokens=12, batch_size=2, max_chars=40)
    codes = [ADD, PARSE, ""]
    first = ex.extract(codes)
    assert ex.extract(codes) == first  # greedy: deterministic
    assert len(first) == 3 and all(isinstance(s, str) and 0 < len(s) <= 40 for s in first)
    assert ex.extract([]) == []


# --------------------------------------------------------------------------- round trip


def _held_out() -> tuple[list[str], list[str]]:
    pairs = public_pairs(400)[200:]  # 0..199 were used to calibrate the default threshold
    return [p for p, _ in pairs], [c for _, c in pairs]


def test_offline_summary_ignores_the_docstring():
    code = 'def scale(xs, k):\n    """Zanzibar quokka."""\n    return [x * k for x in xs]\n'
    summary = OfflineSummarizer().summarize([code])[0]
    assert summary == "function scale taking xs, k; loops over xs; returns x, k, xs"
    assert "quokka" not in summary


def test_round_trip_separates_matching_from_mismatched(embedding):
    prompts, codes = _held_out()
    rt = RoundTripFilter(scorer=embedding)
    assert rt.threshold == DEFAULT_THRESHOLDS["embedding"]
    # Embed each text once: matching = prompt i with code i, mismatched = with code i + 37.
    p_emb, s_emb = embedding.embed(prompts), embedding.embed(rt.summaries(codes))
    match = (p_emb * s_emb).sum(axis=1)
    mism = (p_emb * np.roll(s_emb, -37, axis=0)).sum(axis=1)
    keep_rate, reject_rate = (match >= rt.threshold).mean(), (mism < rt.threshold).mean()
    print(
        f"\nheld-out n={len(codes)}: matching mean {match.mean():.3f}, mismatched mean "
        f"{mism.mean():.3f}; threshold {rt.threshold}: keeps {keep_rate:.1%} of matching, "
        f"rejects {reject_rate:.1%} of mismatched"
    )
    assert match.mean() > mism.mean() + 0.25
    assert keep_rate >= 0.7 and reject_rate >= 0.7
    # The filter's own API gives the same numbers (up to batching noise) and keep == score >= tau.
    some_prompts = prompts[:12] + prompts[:12]
    some_codes = codes[:12] + (codes[37:] + codes[:37])[:12]
    scores = rt.score(some_prompts, some_codes)
    assert scores == pytest.approx([*match[:12], *mism[:12]], abs=1e-4)
    assert rt.keep(some_prompts, some_codes) == [s >= rt.threshold for s in scores]
    assert rt.verdicts(some_prompts, some_codes) == (scores, [s >= rt.threshold for s in scores])
    assert rt.score([], []) == [] and rt.keep([], []) == []
    with pytest.raises(ValueError):
        rt.score(prompts[:2], codes[:3])


def test_round_trip_registries_and_options(ci_path, embedding):
    with pytest.raises(ValueError, match="known: endpoint, hf, offline"):
        make_summarizer("gpt")
    with pytest.raises(ValueError, match="known: bertscore, embedding"):
        make_scorer("rouge")
    with pytest.raises(ValueError, match="prefix"):
        RoundTripFilter(model="x")
    with pytest.raises(ValueError, match="model"):
        RoundTripFilter(scorer="bertscore")
    assert RoundTripFilter(scorer="bertscore", scorer_model="/x").threshold == 0.88
    rt = RoundTripFilter(
        summarizer="hf",
        summarizer_model=ci_path,
        summarizer_max_new_tokens=8,
        scorer=embedding,
        threshold=0.1,
    )
    scores = rt.score(["Add two numbers.", "Parse a header."], [ADD, PARSE])
    assert len(scores) == 2 and all(-1.0 <= s <= 1.0 for s in scores)
    assert rt.score(["Add two numbers.", "Parse a header."], [ADD, PARSE]) == scores


def _bertscore_reference(model_dir: str, cand: str, ref: str) -> float:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()

    def emb(text: str) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[
                0, 1:-1
            ]  # drop CLS/SEP
        return hidden / hidden.norm(dim=-1, keepdim=True)

    sim = emb(cand) @ emb(ref).T
    p = sim.max(dim=1).values.mean()
    r = sim.max(dim=0).values.mean()
    return float(2 * p * r / (p + r))


def test_bertscore_matches_hand_computed_reference():
    model_dir = default_embedding_model()  # a small BERT encoder, as a stand-in for roberta-large
    cand = "Return the sum of two integers."
    ref = "Write a function that adds two numbers and returns the result of the addition."
    scorer = BERTScoreScorer(model=model_dir)
    got = scorer.score([cand, "same text here", "x"], [ref, "same text here", "a much longer text"])
    assert got[0] == pytest.approx(_bertscore_reference(model_dir, cand, ref), abs=1e-4)
    assert got[1] == pytest.approx(1.0, abs=1e-5)
    assert 0.0 < got[0] < 1.0 and 0.0 < got[2] < 1.0
    assert scorer.score([], []) == []


# --------------------------------------------------------------------------- dedup

LONG = """def summarize_orders(orders, cutoff):
    total = 0
    count = 0
    largest = None
    by_customer = {}
    for order in orders:
        if order.amount < cutoff:
            continue
        total += order.amount
        count += 1
        if largest is None or order.amount > largest.amount:
            largest = order
        name = order.customer.strip().lower()
        by_customer.setdefault(name, []).append(order)
    ranking = sorted(by_customer.items(), key=lambda kv: -len(kv[1]))
    top = [name for name, _ in ranking[:3]]
    average = total / count if count else 0.0
    report = {
        "total": total,
        "count": count,
        "average": round(average, 2),
        "largest": largest.amount if largest else None,
        "top": top,
    }
    for key in ("total", "count"):
        if report[key] < 0:
            raise ValueError(key)
    lines = [f"{k}: {v}" for k, v in report.items()]
    text = "\\n".join(lines)
    return report, text
"""


def test_normalize_code():
    a = "def f(a,b):\n    '''Doc.'''\n    # comment\n    return a+b  # trailing\n"
    b = 'def f(a, b):\n\t"""Other doc."""\n\n\treturn  a + b\n'
    assert normalize_code(a) == normalize_code(b) == "def f ( a , b ) :\n    return a + b"
    assert normalize_code("def f(:\n  '''x") == "def f(: '''x"  # untokenizable: whitespace only


def test_dedup_exact_near_and_distinct():
    renamed = LONG.replace("ranking", "ordered")  # one identifier, used twice, renamed
    assert renamed != LONG and LONG.count("ranking") == 2
    sa = set(_shingle_hashes(normalize_code(LONG), 5))
    sb = set(_shingle_hashes(normalize_code(renamed), 5))
    assert len(sa & sb) / len(sa | sb) >= 0.9  # the true Jaccard the MinHash estimates
    commented = "# a copy\n" + LONG.replace("    total = 0\n", "    total  =  0   # start\n\n")
    other = PARSE
    d = Deduplicator()
    assert d.add(["a", "b", "c", "d"], [LONG, commented, renamed, other]) == [None, "a", "a", None]
    assert d.add(["e", "f"], [PARSE, ADD]) == ["d", None]
    assert len(d) == 3


def test_dedup_order_within_batch_and_state_round_trip():
    d = Deduplicator()
    assert d.add(["x", "y", "z"], [PARSE, LONG, "#c\n" + PARSE]) == [None, None, "x"]
    assert d.add(["w"], [LONG.replace("ranking", "ordered")]) == ["y"]
    state = d.state_dict()
    text = json.dumps({**state, "signatures": state["signatures"].tolist()})
    restored = Deduplicator()
    restored.load_state_dict(json.loads(text))
    batch = [ADD, LONG, "#\n" + ADD, STACK, PARSE + "\n\n"]
    ids = [f"n{i}" for i in range(len(batch))]
    assert d.add(ids, batch) == restored.add(ids, batch) == [None, "y", "n0", None, "x"]
    assert d.state_dict()["ids"] == restored.state_dict()["ids"]
    with pytest.raises(ValueError, match="saved with"):
        Deduplicator(threshold=0.9).load_state_dict(state)
    with pytest.raises(ValueError):
        d.add(["a"], [])


@pytest.mark.heavy
def test_dedup_scales_linearly():
    rng = random.Random(0)
    ops = ["+", "-", "*", "//", "%"]
    codes = []
    for i in range(5000):
        n = rng.randint(2, 6)
        body = "\n".join(
            f"    v{j} = {rng.choice('abc')} {rng.choice(ops)} {rng.randint(0, 999)}"
            for j in range(n)
        )
        codes.append(f"def f{i}(a, b, c):\n{body}\n    return v{n - 1}\n")
    copies = ["# copy\n" + codes[i] for i in range(0, 5000, 10)]
    d = Deduplicator()
    start = time.perf_counter()
    first = [
        v
        for s in range(0, 5000, 500)
        for v in d.add([f"r{i}" for i in range(s, s + 500)], codes[s : s + 500])
    ]
    again = d.add([f"c{i}" for i in range(len(copies))], copies)
    elapsed = time.perf_counter() - start
    print(f"\ndedup: {len(codes) + len(copies)} snippets in {elapsed:.2f} s, kept {len(d)}")
    assert again == [f"r{i}" for i in range(0, 5000, 10)]
    assert sum(v is None for v in first) == len(d)


def test_execution_filter_parse_checks_other_languages():
    """synth.parse_check_languages: Go that parses passes as 'parsed:go' (not executed);
    Python is still executed; text that parses nowhere is executed and fails."""
    import numpy as np

    from privcode.sandbox import is_full, isolation_level
    from privcode.synth.operators import ExecutionFilter

    if not is_full(isolation_level()):
        require_or_skip(REQUIRE_SANDBOX, f"needs the full sandbox; here: {isolation_level()}")
    f = ExecutionFilter({"wall_seconds": 5.0}, 2, parse_check=("go", "rust"))
    codes = [
        "func Add(a, b int) int {\n\treturn a + b\n}\n",
        "print(6 * 7)\n",
        "fn f(x: i32) -> i32 { x }\n",
        "this is { not code (\n",
    ]
    out = f({"code": np.array(codes, dtype=object)})
    assert list(out["exec_status"]) == ["parsed:go", "ok", "parsed:rust", "syntax"]
    assert list(out["exec_passed"]) == [True, True, True, False]
    assert (
        out["exec_isolation"][0] == "parse-check" and out["exec_isolation"][1] == isolation_level()
    )


# --------------------------------------------------------------------------- round-trip speed-ups


def test_row_int8_linear_is_batch_independent_and_matches_a_numpy_reference():
    from privcode.models.rowint8 import RowInt8Linear, quantize_rows

    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(48, 24)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 48, generator=gen))
    x = torch.randn(5, 7, 48, generator=gen)
    q = RowInt8Linear(linear)
    got = q(x)
    # Independent reference: the same formula in float64 NumPy.
    w = linear.weight.detach().double().numpy()
    ws = np.abs(w).max(axis=1) / 127.0
    wq = np.clip(np.round(w / ws[:, None]), -127, 127)
    rows = x.reshape(-1, 48).double().numpy()
    xs = np.abs(rows).max(axis=1, keepdims=True) / 127.0
    xq = np.clip(np.round(rows / xs), -127, 127)
    want = (xq @ wq.T) * xs * ws + linear.bias.detach().double().numpy()
    assert np.allclose(got.reshape(-1, 24).double().numpy(), want, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        exact = linear(x)
    assert float((got - exact).abs().max() / exact.abs().max()) < 0.02  # int8 error, small
    # A row's result is its own: alone, or beside rows 100x larger, it is the same.
    alone = q(x[:1, :1])
    beside = q(torch.cat([x[:1, :1], 100 * x[1:2, :1]], dim=0))[:1]
    assert torch.equal(alone, beside)
    model = quantize_rows(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    assert isinstance(model[0], RowInt8Linear) and isinstance(model[1], torch.nn.ReLU)


def test_length_batches_cover_every_text_within_the_budget():
    from privcode.models.embedding import length_batches

    lengths = [5, 130, 7, 7, 60, 3, 128, 12, 9, 1000]
    batches = length_batches(lengths, budget=128, cap=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths)  # shortest first, no text split from its neighbours
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 128
    assert [lengths[i] for i in batches[-1]] == [1000]  # over the budget: alone
    assert length_batches([], 64) == []


def test_embedding_scorer_speed_ups_keep_the_scores():
    prompts, codes = _held_out()
    prompts, codes = prompts[:40], codes[:40]
    plain = EmbeddingScorer(precision="float32", cache_size=0, token_budget=0)
    fast = EmbeddingScorer(precision="float32", cache_size=0, token_budget=256)
    texts = [*prompts, *codes]
    assert np.allclose(fast.embed(texts), plain.embed(texts), atol=1e-5)  # token batches

    cached = EmbeddingScorer(precision="float32", cache_size=16)
    calls = []
    encode = cached._encode
    cached._encode = lambda batch: calls.append(list(batch)) or encode(batch)
    twice = cached.embed([*prompts[:10], *prompts[:10]])  # repeats: encoded once
    assert calls == [prompts[:10]] and np.allclose(twice[:10], twice[10:], atol=0)
    assert np.allclose(cached.embed(prompts[5:12]), plain.embed(prompts[5:12]), atol=1e-5)
    assert calls[1] == prompts[10:12]  # 5..9 came from the cache
    cached.embed(prompts[20:40])
    assert len(cached._cache) == 16  # LRU bound

    int8 = EmbeddingScorer(precision="int8")  # with window 128, token batches, a cache
    auto = EmbeddingScorer()
    auto.embed(["x"])
    assert auto.precision in ("bfloat16", "int8")  # resolved on load
    ref = plain.score(prompts, codes)
    got = int8.score(prompts, codes)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 0.05
    assert max(abs(a - b) for a, b in zip(auto.score(prompts, codes), ref, strict=True)) < 0.05
    alone = EmbeddingScorer(precision="int8").score(prompts[:1], codes[:1])  # no neighbours
    assert alone == pytest.approx(got[:1], abs=1e-6)
    with pytest.raises(ValueError, match="precision"):
        EmbeddingScorer(precision="fp8")


def test_bertscore_length_batches_give_the_same_scores():
    model_dir = default_embedding_model()
    cands = ["Return the sum of two integers.", "x", "Parse the header line of a CSV file " * 6]
    refs = ["Add two numbers.", "a much longer text than the candidate", "Read a CSV header."]
    one_batch = BERTScoreScorer(model=model_dir, token_budget=1 << 20).score(cands, refs)
    small = BERTScoreScorer(model=model_dir, token_budget=16, batch_size=2).score(cands, refs)
    assert small == pytest.approx(one_batch, abs=1e-5)
