"""Structural tokens, the syntax KL term and its weight schedule (privcode.train.syntax).

Expected offsets are counted by hand and hard-coded; the texts they cut out
of the snippet are checked too, so a wrong hand count shows up as such.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import textwrap

import pytest
import torch

from privcode.models.encoding import STRUCTURAL_NAMES, structural_flags, structural_spans
from privcode.train.syntax import ast_lambda, kl_at_positions


def texts(code: str, spans: list[tuple[int, int]]) -> list[str]:
    return [code[s:e] for s, e in spans]


# -- structural_spans ---------------------------------------------------------


def test_spans_function_definition():
    code = "def f(x):\n    return len(x) + 1\n"
    spans = structural_spans(code)
    assert spans == [
        (0, 3),
        (5, 6),
        (7, 8),
        (8, 9),
        (14, 20),
        (21, 24),
        (24, 25),
        (26, 27),
        (28, 29),
    ]
    assert texts(code, spans) == ["def", "(", ")", ":", "return", "len", "(", ")", "+"]


def test_spans_exclude_strings_comments_numbers_identifiers():
    code = 'x = foo("hi", 42)  # note\n'
    spans = structural_spans(code)
    assert spans == [(2, 3), (7, 8), (12, 13), (16, 17)]
    assert texts(code, spans) == ["=", "(", ",", ")"]


def test_spans_keywords_and_constants_but_not_underscore():
    code = "y = lambda a: a if a is not None else True in _\n"
    spans = structural_spans(code)
    assert spans == [
        (2, 3),
        (4, 10),
        (12, 13),
        (16, 18),
        (21, 23),
        (24, 27),
        (28, 32),
        (33, 37),
        (38, 42),
        (43, 45),
    ]
    assert texts(code, spans) == [
        "=",
        "lambda",
        ":",
        "if",
        "is",
        "not",
        "None",
        "else",
        "True",
        "in",
    ]


def test_spans_soft_keywords_and_builtins():
    code = "match v:\n    case int():\n        raise ValueError(type(v))\n"
    got = texts(code, structural_spans(code))
    assert got == [
        "match",
        ":",
        "case",
        "int",
        "(",
        ")",
        ":",
        "raise",
        "ValueError",
        "(",
        "type",
        "(",
        ")",
        ")",
    ]
    assert "_" not in STRUCTURAL_NAMES and "print" in STRUCTURAL_NAMES


def test_spans_multichar_operators():
    code = "def g(a) -> int:\n    a **= 2; return a // 3 != ...\n"
    got = texts(code, structural_spans(code))
    assert got == ["def", "(", ")", "->", "int", ":", "**=", ";", "return", "//", "!=", "..."]


def test_spans_crlf_line_endings():
    code = "if x:\r\n    print(x)\r\n"
    spans = structural_spans(code)
    assert spans == [(0, 2), (4, 5), (11, 16), (16, 17), (18, 19)]
    assert texts(code, spans) == ["if", ":", "print", "(", ")"]


def test_spans_line_splitting_matches_readline_not_splitlines():
    # str.splitlines would break after "\x1c" and shift every later offset.
    code = 'a = "\x1c"\nb = len(a)\n'
    spans = structural_spans(code)
    assert spans == [(2, 3), (10, 11), (12, 15), (15, 16), (17, 18)]
    assert texts(code, spans) == ["=", "=", "len", "(", ")"]


def test_spans_are_character_offsets_not_bytes():
    code = "π = 'é😀'\nprint(π)\n"
    spans = structural_spans(code)
    assert spans == [(2, 3), (9, 14), (14, 15), (16, 17)]
    assert texts(code, spans) == ["=", "print", "(", ")"]


def test_spans_fstring_on_running_python():
    code = 's = f"{a + len(b)}!"\n'
    spans = structural_spans(code)
    if sys.version_info >= (3, 12):
        # Replacement fields are tokenized: their braces/operators are OP.
        assert spans == [(2, 3), (6, 7), (9, 10), (11, 14), (14, 15), (16, 17), (17, 18)]
        assert texts(code, spans) == ["=", "{", "+", "len", "(", ")", "}"]
    else:
        # Before 3.12 the whole f-string is one STRING token.
        assert spans == [(2, 3)]


def test_spans_empty_and_no_trailing_newline():
    assert structural_spans("") == []
    assert structural_spans("return(x)") == [(0, 6), (6, 7), (8, 9)]


@pytest.mark.parametrize(
    "code",
    [
        "def f(:\n  '''unterminated",  # EOF in a multi-line string
        "if x:\n        a\n    b\n",  # dedent to no outer level
        "x = (1,\n",  # EOF inside a bracket
        "a $ b\n",  # not a Python character
        "x = 'abc\n",  # unterminated single-line string
    ],
)
def test_untokenizable_code_gives_none(code):
    assert structural_spans(code) is None
    assert structural_flags(code, [(0, 1), (len(code) - 1, len(code))]) is None


def test_only_the_covered_prefix_must_tokenize():
    """A record cut to its first tokens: what lies after the last offset is never read."""
    code = "x = f(a)\ny = 'abc\n"  # the second line does not tokenize
    assert structural_spans(code) is None
    assert structural_spans(code, limit=8) == [(2, 3), (5, 6), (7, 8)]
    assert structural_flags(code, [(0, 1), (1, 3), (3, 5), (5, 6), (6, 7), (7, 8)]) == [
        False,
        True,
        False,
        True,
        False,
        True,
    ]
    assert structural_flags(code, [(0, 1), (13, 17)]) is None  # the bad string is covered


# -- structural_flags ---------------------------------------------------------


def test_flags_hand_written_offsets():
    code = "for i in f(x):\n    pass\n"
    assert texts(code, structural_spans(code)) == ["for", "in", "(", ")", ":", "pass"]
    cases = [
        ((0, 3), True),  # "for"
        ((3, 5), False),  # " i"
        ((5, 8), True),  # " in": leading whitespace is stripped
        ((6, 10), False),  # "in f": contains an identifier
        ((8, 10), False),  # " f"
        ((10, 12), False),  # "(x": mixed
        ((12, 14), True),  # "):": two adjacent structural tokens
        ((14, 19), False),  # "\n    ": whitespace only
        ((19, 21), True),  # "pa": part of a keyword
        ((19, 24), True),  # "pass\n": trailing whitespace is stripped
        ((23, 24), False),  # "\n"
        ((0, 0), False),  # zero-length (special token)
        ((24, 24), False),  # zero-length at the end
    ]
    flags = structural_flags(code, [span for span, _ in cases])
    assert flags == [want for _, want in cases]


def test_flags_reject_spans_outside_code():
    with pytest.raises(ValueError):
        structural_flags("x = 1\n", [(0, 7)])
    with pytest.raises(ValueError):
        structural_flags("x = 1\n", [(3, 2)])


@pytest.fixture(scope="module")
def tokenizer():
    from privcode.models.tokenizer import train_tokenizer

    lines = inspect.getsource(textwrap).splitlines(keepends=True)[:400]
    return train_tokenizer(lines, vocab_size=600)


SNIPPET = """\
def tally(items):
    my_counter = 0
    for item in items:
        if item is not None:
            my_counter += len(item)
    return my_counter
"""


def test_flags_with_real_tokenizer(tokenizer):
    enc = tokenizer(SNIPPET, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    flags = structural_flags(SNIPPET, offsets)
    assert len(flags) == len(ids) and any(flags) and not all(flags)

    structural_chars = set()
    for s, e in structural_spans(SNIPPET):
        structural_chars.update(range(s, e))
    for tid, (s, e), flag in zip(ids, offsets, flags, strict=True):
        text = tokenizer.decode([tid])
        assert text == SNIPPET[s:e]
        if flag:
            stripped = text.strip()
            lead = len(text) - len(text.lstrip())
            assert stripped
            assert set(range(s + lead, s + lead + len(stripped))) <= structural_chars
            # Independent check: only keyword/builtin letters and punctuation.
            for word in re.findall(r"\w+", stripped):
                assert any(word in name for name in STRUCTURAL_NAMES), (word, text)

    def flags_over(word: str) -> list[bool]:
        out = []
        for match in re.finditer(rf"\b{word}\b", SNIPPET):
            out += [
                f
                for (s, e), f in zip(offsets, flags, strict=True)
                if s < match.end() and e > match.start()
            ]
        assert out
        return out

    assert all(flags_over("return"))
    assert all(flags_over("for"))
    assert all(flags_over("len"))
    assert not any(flags_over("my_counter"))
    assert not any(flags_over("tally"))


# -- ast_lambda -----------------------------------------------------------------


def test_ast_lambda_values():
    assert ast_lambda(0) == 1000.0
    assert ast_lambda(1) == 0.1 + 999.9 * math.exp(-0.01)
    assert ast_lambda(5, dt=2) == 0.1 + 999.9 * math.exp(-0.02)
    assert ast_lambda(4, dt=2) == ast_lambda(5, dt=2)  # staircase of width dt
    assert ast_lambda(10**6) == pytest.approx(0.1, abs=1e-12)
    assert ast_lambda(123, alpha=0.0) == 1000.0
    assert ast_lambda(7, lambda_max=2.0, lambda_min=2.0) == 2.0
    assert ast_lambda(3, 10.0, 0.0, 0.5, 1) == 10.0 * math.exp(-1.5)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"step": -1}, "step"),
        ({"step": 0, "dt": 0}, "dt"),
        ({"step": 0, "alpha": -0.1}, "alpha"),
        ({"step": 0, "alpha": float("nan")}, "alpha"),
        ({"step": 0, "lambda_min": -1.0}, "lambda_min"),
        ({"step": 0, "lambda_max": 0.05}, "lambda_max"),
    ],
)
def test_ast_lambda_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        ast_lambda(**kwargs)


# -- kl_at_positions ------------------------------------------------------------


def make(seed: int = 0, b: int = 3, t: int = 5, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    junior = torch.randn(b, t, v, generator=g) * 2
    ref = torch.randn(b, t, v, generator=g) * 2
    mask = torch.rand(b, t, generator=g) < 0.5
    mask[0, 0], mask[1, :] = True, False  # row 1 has no masked position
    return junior, ref, mask


def reference_kl(junior, ref, mask):
    p = torch.distributions.Categorical(logits=junior.float())
    q = torch.distributions.Categorical(logits=ref.float())
    per_pos = torch.distributions.kl_divergence(p, q)  # [B, T]
    return (per_pos * mask.float()).sum(dim=1)


def test_kl_is_zero_for_identical_logits():
    junior, _, mask = make()
    out = kl_at_positions(junior, junior.clone(), mask)
    assert out.shape == (3,) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.zeros(3), atol=1e-7, rtol=0)


def test_kl_matches_hand_computation():
    junior, ref, mask = make()
    out = kl_at_positions(junior, ref, mask)
    torch.testing.assert_close(out, reference_kl(junior, ref, mask), atol=1e-5, rtol=1e-5)
    # Explicit formula at one position.
    pj, pr = junior[0, 0].softmax(-1), ref[0, 0].softmax(-1)
    single = torch.zeros_like(mask)
    single[0, 0] = True
    expected = (pj * (pj.log() - pr.log())).sum()
    torch.testing.assert_close(kl_at_positions(junior, ref, single)[0], expected)
    assert out[1] == 0.0 and (out[[0, 2]] > 0).all()
    # A 0/1 mask means the same as a bool mask.
    torch.testing.assert_close(kl_at_positions(junior, ref, mask.long()), out, atol=0, rtol=0)


def test_kl_low_precision_inputs_give_float32():
    junior, ref, mask = make()
    out = kl_at_positions(junior.bfloat16(), ref.bfloat16(), mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out, reference_kl(junior.bfloat16(), ref.bfloat16(), mask), atol=1e-4, rtol=1e-4
    )


def test_kl_ignores_masked_out_positions():
    junior, ref, mask = make()
    out = kl_at_positions(junior, ref, mask)
    j2, r2 = junior.clone(), ref.clone()
    j2[~mask] = torch.randn(int((~mask).sum()), junior.shape[-1]) * 10
    r2[~mask] = torch.randn(int((~mask).sum()), junior.shape[-1]) * 10
    assert torch.equal(kl_at_positions(j2, r2, mask), out)


def test_kl_rows_are_independent():
    junior, ref, mask = make()
    out = kl_at_positions(junior, ref, mask)
    j2, r2 = junior.clone(), ref.clone()
    j2[2] += torch.randn_like(j2[2]) * 5
    r2[2] -= 3.0 * torch.randn_like(r2[2])
    out2 = kl_at_positions(j2, r2, mask)
    assert torch.equal(out2[:2], out[:2])
    assert out2[2] != out[2]


def test_kl_gradient_only_at_masked_positions_and_not_to_ref():
    junior, ref, mask = make()
    junior.requires_grad_(True)
    ref.requires_grad_(True)
    kl_at_positions(junior, ref, mask).sum().backward()
    assert ref.grad is None
    assert torch.equal(junior.grad[~mask], torch.zeros_like(junior.grad[~mask]))
    assert (junior.grad[mask].abs().sum(dim=-1) > 0).all()


def test_kl_empty_mask_is_zeros_and_backpropagates():
    junior, ref, _ = make()
    junior.requires_grad_(True)
    out = kl_at_positions(junior, ref, torch.zeros(3, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(3))
    out.sum().backward()
    assert torch.equal(junior.grad, torch.zeros_like(junior))


def test_kl_rejects_shape_mismatch():
    junior, ref, mask = make()
    with pytest.raises(ValueError):
        kl_at_positions(junior, ref[:, :, :-1], mask)
    with pytest.raises(ValueError):
        kl_at_positions(junior, ref, mask[:, :-1])


def test_structural_tokens_of_other_languages_come_from_their_grammar():
    """Ingested Go / Rust / JavaScript records: keywords, operators, punctuation only."""
    import re

    for lang, code, want in (
        (
            "go",
            "func Add(a, b int) int {\n\treturn a + b\n}\n",
            ["func", "(", ",", ")", "{", "return", "+", "}"],
        ),
        (
            "rust",
            "fn double(x: i32) -> i32 { x * 2 }\n",
            ["fn", "(", ":", ")", "->", "{", "*", "}"],
        ),
        (
            "javascript",
            "function f(a) { return a.b ?? 0; }\n",
            ["function", "(", ")", "{", "return", ".", "??", ";", "}"],
        ),
    ):
        tokens = [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]+", code)]
        flags = structural_flags(code, tokens, lang)
        assert flags is not None
        assert [code[s:e] for (s, e), f in zip(tokens, flags, strict=True) if f] == want, lang
    assert structural_flags("func (", [(0, 4)], "go") is None  # does not parse
    assert structural_flags("x y", [(0, 1)], "cobol") is None  # no grammar: no structure
    py = "def f(x):\n    return len(x)\n"
    toks = [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]+", py)]
    assert structural_flags(py, toks) == structural_flags(py, toks, "python")
