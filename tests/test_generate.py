"""``privcode.models.generate``: the one batched generate, on a tiny random Llama.

Seeded batches draw exactly what Hugging Face's own ``do_sample`` draws after
``torch.manual_seed`` (the old paths' behaviour), per-row seeds do not depend on the batch,
and each row ends at its own EOS, ``max_new_tokens`` or stop string. The six callers'
outputs against the code before this module: ``tests/test_generate_golden.py``.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from privcode.models.generate import generate

VOCAB = 64
EOS = 0


class CharTokenizer:
    """Token ``i`` is one letter (``i % 26``); 0 is EOS, 1 is pad (both special)."""

    eos_token_id, pad_token_id, bos_token_id = EOS, 1, None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(
            chr(97 + i % 26) for i in ids if i not in (EOS, 1) or not skip_special_tokens
        )

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [2 + (ord(c) - 97) % 26 for c in text]}


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = T.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            eos_token_id=EOS,
            pad_token_id=1,
        )
        return T.LlamaForCausalLM(config).eval()


ROWS = [[5, 9, 11], [7, 3], [12, 4, 8, 20]]


def _hf(model, rows, **kw):
    """The old paths: left padding, torch.manual_seed, HF's own sampling."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[1] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(kw.pop("seed"))
        out = model.generate(
            input_ids=ids, attention_mask=mask, pad_token_id=1, eos_token_id=EOS, **kw
        )
    return out[:, width:].tolist()


def _cut(row):
    return row[: row.index(EOS)] if EOS in row else row


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
def test_a_seeded_batch_draws_what_hf_do_sample_drew(model, top_p):
    ref = _hf(
        model,
        ROWS,
        seed=7,
        do_sample=True,
        temperature=0.8,
        top_p=top_p,
        top_k=0,
        max_new_tokens=12,
    )
    got = generate(
        model,
        CharTokenizer(),
        input_ids=ROWS,
        max_new_tokens=12,
        temperature=0.8,
        top_p=top_p,
        seed=7,
    )
    assert [list(g.tokens) for g in got] == [_cut(r) for r in ref]
    greedy = _hf(model, ROWS, seed=0, do_sample=False, max_new_tokens=12)
    assert [
        list(g.tokens) for g in generate(model, CharTokenizer(), input_ids=ROWS, max_new_tokens=12)
    ] == [_cut(r) for r in greedy]
    assert [list(g.tokens) for g in got] != [_cut(r) for r in greedy]  # it did sample


def test_per_row_seeds_do_not_depend_on_the_batch(model):
    tok = CharTokenizer()
    alone = generate(model, tok, input_ids=ROWS[:1], max_new_tokens=10, temperature=1.0, seed=[3])
    mixed = generate(
        model,
        tok,
        input_ids=ROWS,
        max_new_tokens=10,
        temperature=[1.0, 0.0, 0.7],
        top_p=[1.0, 1.0, 0.8],
        seed=[3, None, 4],
    )
    assert mixed[0] == alone[0]
    assert mixed[1] == generate(model, tok, input_ids=ROWS[1:2], max_new_tokens=10)[0]  # greedy
    shared = torch.Generator().manual_seed(5)  # one stream continued over two calls
    first = generate(model, tok, input_ids=ROWS, max_new_tokens=6, temperature=1.0, seed=shared)
    second = generate(model, tok, input_ids=ROWS, max_new_tokens=6, temperature=1.0, seed=shared)
    again = torch.Generator().manual_seed(5)
    assert (
        generate(model, tok, input_ids=ROWS, max_new_tokens=6, temperature=1.0, seed=again) == first
    )
    assert second != first


def test_each_row_stops_at_its_eos_max_tokens_or_stop_string(model):
    tok = CharTokenizer()
    full = generate(model, tok, input_ids=ROWS, max_new_tokens=16, temperature=1.0, seed=3)
    text = full[0].text
    assert len(text) >= 4, "the seeded sample is long enough to cut"
    stop = text[2:4]
    got = generate(
        model,
        tok,
        input_ids=ROWS,
        max_new_tokens=[16, 3, 16],
        temperature=1.0,
        seed=3,
        stop=[[stop], [], ["\x00never"]],
    )
    cut = text[: text.find(stop)]
    assert got[0].text == cut and got[0].finish_reason == "stop"
    assert got[0].completion_tokens == text.find(stop) + 2  # decoding stopped with the stop string
    assert got[1].text == full[1].text[:3] and got[1].completion_tokens == min(
        3, full[1].completion_tokens
    )
    assert got[2] == full[2]
    for g in full:  # EOS trimmed and counted, or the length reached
        assert g.finish_reason == (
            "length" if g.completion_tokens == 16 and len(g.tokens) == 16 else "stop"
        )
        assert EOS not in g.tokens


def test_prefix_embeddings_and_text_prompts(model):
    tok = CharTokenizer()
    by_ids = generate(model, tok, input_ids=[ROWS[0]] * 2, max_new_tokens=8)
    embeds = model.get_input_embeddings()(torch.tensor([ROWS[0]] * 2)).detach()
    assert generate(model, tok, inputs_embeds=embeds, max_new_tokens=8) == by_ids
    assert generate(model, tok, prompts=["dhj"], max_new_tokens=8)[0] == by_ids[0]  # ids 5, 9, 11


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": ROWS, "prompts": ["a"]}, "exactly one"),
        ({"input_ids": [[]]}, "no empty row"),
        ({"input_ids": ROWS, "temperature": -1.0}, "temperature"),
        ({"input_ids": ROWS, "top_p": 0.0}, "top_p"),
        ({"input_ids": ROWS, "max_new_tokens": [4, 4]}, "2 values for 3 rows"),
        ({"input_ids": ROWS, "stop": "\n"}, "not a string"),
    ],
)
def test_bad_arguments_name_what_is_wrong(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(model, CharTokenizer(), **{"max_new_tokens": 4, **kwargs})
