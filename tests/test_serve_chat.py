"""Chat completions, streaming, n > 1 and log-probs on the premium app (in process, no Ray)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_support import TEST_KEY, asgi_call, limits

from privcode.models.chat import CHAT_TEMPLATE, prompt_text, render_chat
from privcode.serve.api import parse_completion
from privcode.serve.premium import PremiumModel, build_api
from privcode.serve.streaming import TextStream

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def premium(premium_release):
    return PremiumModel(premium_release, device="cpu", max_tokens_limit=64)


@pytest.fixture(scope="module")
def api(premium):
    async def generate(item):
        result = (await asyncio.to_thread(premium.generate_batch, [item]))[0]
        if isinstance(result, Exception):
            raise result
        return result

    return build_api(premium, generate, limits())


def _post(api, path, body):
    status, data, _ = asgi_call(api, "POST", path, body, key=TEST_KEY)
    return status, data


def _events(api, path, body):
    """The data payloads of a streamed answer (the test client reads the whole stream)."""
    from starlette.testclient import TestClient

    with TestClient(api) as client:
        headers = {"authorization": f"Bearer {TEST_KEY}"}
        with client.stream("POST", path, json=body, headers=headers) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = "".join(resp.iter_text())
    payloads = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


# --------------------------------------------------------------------------- the template


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)


@settings(max_examples=60, deadline=None)
@given(prompt=text, code=text, system=text)
def test_the_chat_template_renders_the_training_rows(premium, prompt, code, system):
    tok, eos = premium.tokenizer, premium.tokenizer.eos_token
    turn = [{"role": "user", "content": prompt}, {"role": "assistant", "content": code}]
    # [user p, assistant c] is the training text of (p, c); [user p] the prompt to continue.
    assert render_chat(tok, turn, add_generation_prompt=False) == prompt_text(prompt) + code + eos
    assert render_chat(tok, turn[:1]) == prompt_text(prompt)
    sys_turn = [{"role": "system", "content": system}, *turn[:1]]
    head = system.rstrip() + "\n\n" if system.strip() else ""
    assert render_chat(tok, sys_turn) == head + prompt_text(prompt)


def test_the_release_records_the_template_and_old_releases_use_the_kits(premium, tmp_path):
    from privcode.artifacts.premium import PremiumRecord

    assert premium.chat_template is None  # the fixture's premium.json predates it
    msgs = [{"role": "user", "content": PROMPT}]
    assert premium.chat_prompt(msgs) == render_chat(premium.tokenizer, msgs, CHAT_TEMPLATE)
    assert "chat_template" in {f.name for f in PremiumRecord._fields()}


# --------------------------------------------------------------------------- chat


def test_a_chat_turn_is_the_completion_of_its_rendered_prompt(api):
    status, chat = _post(
        api,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12},
    )
    assert status == 200, chat
    status, plain = _post(api, "/v1/completions", {"prompt": PROMPT + "\n", "max_tokens": 12})
    assert status == 200
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    choice = chat["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": plain["choices"][0]["text"]}
    assert choice["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chat["usage"] == plain["usage"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ({"messages": [{"role": "user", "content": "x" * 70_000}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, "max_tokens"),
    ],
)
def test_bad_chat_bodies_name_the_field(api, body, param):
    status, data = _post(api, "/v1/chat/completions", body)
    assert status == 400 and data["error"]["param"] == param, data


# --------------------------------------------------------------------------- n and logprobs


def test_n_choices_are_seeded_rows_reproducible_alone(api):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "n": 3}
    status, data = _post(api, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in data["choices"]]
    # choice i is the request seeded seed + i, on its own
    for i, text in enumerate(texts):
        alone = _post(api, "/v1/completions", {**body, "n": 1, "seed": 7 + i})[1]
        assert alone["choices"][0]["text"] == text
    assert len(set(texts)) > 1
    per = [
        _post(api, "/v1/completions", {**body, "n": 1, "seed": 7 + i})[1]["usage"] for i in range(3)
    ]
    assert data["usage"]["completion_tokens"] == sum(u["completion_tokens"] for u in per)


def _reference_logprobs(premium, prompt_ids, tokens):
    """log_softmax of the model's logits at each generated position, by one forward pass."""
    ids = torch.tensor([list(prompt_ids) + list(tokens)])
    with torch.inference_mode():
        logits = premium.model(input_ids=ids).logits[0].float()
    lsm = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1
    return [lsm[start + i] for i in range(len(tokens))]


def test_logprobs_are_the_models_own_and_the_top_ones_are_sorted(api, premium):
    status, data = _post(
        api,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert status == 200
    content = data["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == data["choices"][0]["message"]["content"]
    # The same request without HTTP: its records carry the token ids, checked against one
    # independent forward pass over prompt + completion.
    request = parse_completion({"prompt": PROMPT + "\n", "max_tokens": 8, "logprobs": 3}, 64)
    records = premium.complete(request).logprobs
    ids = premium.prepare(request).ids
    reference = _reference_logprobs(premium, ids, [r.token for r in records])
    assert len(content) == len(records) > 0
    for entry, record, lsm in zip(content, records, reference, strict=True):
        assert math.isclose(entry["logprob"], record.logprob, abs_tol=1e-6)
        assert math.isclose(record.logprob, float(lsm[record.token]), abs_tol=1e-4)
        tops = [x["logprob"] for x in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert [i for i, _ in record.top] == torch.topk(lsm, 3).indices.tolist()
        assert math.isclose(tops[0], float(lsm.max()), abs_tol=1e-4)
        assert math.isclose(entry["logprob"], tops[0], abs_tol=1e-4)  # greedy: the top one
    status, legacy = _post(
        api, "/v1/completions", {"prompt": PROMPT + "\n", "max_tokens": 8, "logprobs": 2}
    )
    lp = legacy["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([c["logprob"] for c in content], abs=1e-5)
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0


# --------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_join_to_the_greedy_answer(api, path):
    chat = path.endswith("chat/completions")
    body = (
        {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT + "\n"}
    ) | {"max_tokens": 16, "n": 2}
    whole = _post(api, path, body)[1]
    chunks = _events(api, path, body | {"stream": True, "stream_options": {"include_usage": True}})
    *deltas, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == i]
        if chat:
            assert mine[0]["delta"]["role"] == "assistant"
            joined = "".join(c["delta"].get("content", "") for c in mine)
            assert joined == choice["message"]["content"]
        else:
            assert "".join(c["text"] for c in mine) == choice["text"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
    assert all(
        c["object"] == ("chat.completion.chunk" if chat else "text_completion") for c in deltas
    )
    assert len({c["id"] for c in chunks}) == 1


def test_the_text_stream_holds_back_a_possible_stop_string(premium):
    tok = premium.tokenizer
    ids = tok("ab\n\nreturn x\n", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, stops=["\n\n"])
    sent = "".join(stream.push(t) for t in ids)
    assert sent == "ab"  # cut before the stop string; nothing after it
    assert stream.finish("ab") == ""
    stream = TextStream(tok, stops=["\nreturn"])
    out = [stream.push(t) for t in tok("x = 1\nre", add_special_tokens=False)["input_ids"]]
    assert "".join(out) == "x = 1"  # "\nre" may still become the stop: held back
    assert stream.finish("x = 1\nre") == "\nre"


def test_a_streamed_choice_carries_its_logprobs_on_its_last_chunk(api):
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "max_completion_tokens": 8,  # both given: the smaller counts
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = _post(api, "/v1/chat/completions", body)[1]
    assert whole["usage"]["completion_tokens"] <= 6
    chunks = _events(api, "/v1/chat/completions", body | {"stream": True})
    *first, last = [c["choices"][0] for c in chunks]
    assert all(c["logprobs"] is None for c in first)
    assert last["logprobs"] == whole["choices"][0]["logprobs"]
