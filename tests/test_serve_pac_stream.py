"""The PAC app's chat route and streaming (in process, no Ray): tokens charged as released, a
client that leaves stops the decode, log-probabilities refused by name."""

from __future__ import annotations

import asyncio
import json

import pytest
from serve_support import TEST_KEY, asgi_call, limits

from privcode.serve.api import parse_completion
from privcode.serve.ensemble import PacService, build_api, new_curator, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def add(a, b):"
B = 2.0**-16


@pytest.fixture(scope="module")
def ensemble(pac_worlds):
    from privcode.pac.ensemble import PacEnsemble

    return PacEnsemble(pac_worlds, device="cpu")


@pytest.fixture(scope="module")
def unanimous(pac_unanimous):
    return pac_unanimous


def _service(ensemble, tmp_path, **args):
    cfg = parse_args({"worlds": "/unused", "max_tokens_limit": 32, **args})
    svc = PacService(ensemble, new_curator(cfg, ensemble.m, state_dir=tmp_path, rng_seed=0), cfg)
    svc.api = build_api(svc, limits())
    return svc


@pytest.fixture()
def service(ensemble, tmp_path):
    svc = _service(ensemble, tmp_path / "state")
    yield svc
    svc.close()


def _post(svc, path, body):
    status, data, _ = asgi_call(svc.api, "POST", path, body, key=TEST_KEY)
    return status, data


def _events(svc, path, body):
    from starlette.testclient import TestClient

    with TestClient(svc.api) as client:
        headers = {"authorization": f"Bearer {TEST_KEY}"}
        with client.stream("POST", path, json=body, headers=headers) as resp:
            assert resp.status_code == 200
            raw = "".join(resp.iter_text())
    payloads = [p[len("data: ") :] for p in raw.split("\n\n") if p]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_pac_chat_is_the_completion_of_the_worlds_template(unanimous, tmp_path):
    svc = _service(unanimous, tmp_path)
    try:
        chat = _post(
            svc,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10},
        )[1]
        plain = _post(svc, "/v1/completions", {"prompt": PROMPT + "\n", "max_tokens": 10})[1]
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        assert chat["privacy"]["private_tokens"] == 0  # unanimous worlds: free
        assert chat["usage"] == plain["usage"]
    finally:
        svc.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_pac_streamed_chunks_join_to_the_greedy_answer(unanimous, tmp_path, path):
    svc = _service(unanimous, tmp_path)
    chat = path.endswith("chat/completions")
    body = (
        {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT + "\n"}
    ) | {"max_tokens": 16}
    try:
        whole = _post(svc, path, body)[1]
        chunks = _events(
            svc, path, body | {"stream": True, "stream_options": {"include_usage": True}}
        )
    finally:
        svc.close()
    *deltas, usage = chunks
    assert usage["usage"] == whole["usage"] and usage["choices"] == []
    choices = [c["choices"][0] for c in deltas]
    text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in choices)
    assert text == (
        whole["choices"][0]["message"]["content"] if chat else whole["choices"][0]["text"]
    )
    assert choices[-1]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert deltas[-1]["privacy"]["charged_nats"] == 0.0  # the accounting on the last chunk


def test_pac_streams_charge_each_token_and_a_client_that_leaves_stops_the_decode(service):
    sid = _post(service, "/v1/sessions", {})[1]["id"]
    max_tokens = 32

    async def read_then_leave(n):
        request = parse_completion({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True}, 32)
        events = await service.complete("default", request, sid)
        got = []
        async for event in events:
            got.append(json.loads(event[len(b"data: ") :]))
            if len(got) == n:
                break
        await events.aclose()  # the client goes away
        await asyncio.sleep(0.5)  # the worker notices before its next step
        return got

    got = asyncio.run(read_then_leave(3))
    assert all(c["choices"][0]["finish_reason"] is None for c in got)
    info = _post(service, "/v1/sessions", {})  # the worker is free again: a new request runs
    assert info[0] == 200
    session = asgi_call(service.api, "GET", f"/v1/sessions/{sid}", key=TEST_KEY)[1]
    released = session["private_tokens"] + session["free_tokens"] + session["fallback_tokens"]
    # What was charged is what was sent (tokens go out in lockstep) and the one step in flight
    # when the client left: b per private token, no more, far before max_tokens.
    assert session["charged_nats"] == pytest.approx(B * session["private_tokens"], rel=1e-12)
    assert 3 <= released <= 3 + 1 < max_tokens
    assert session["private_tokens"] > 0


@pytest.mark.parametrize(
    "path, extra",
    [
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 0}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
        ),
    ],
)
def test_pac_refuses_logprobs_by_name(service, path, extra):
    status, data = _post(service, path, extra)
    assert status == 400 and data["error"]["param"] == "logprobs"
    assert "not what its curator releases" in data["error"]["message"]
    assert service.curator.deployment_info()["deployment_charged"] == 0


def test_pac_chat_refuses_n_and_top_p(service):
    msgs = [{"role": "user", "content": "x"}]
    assert (
        _post(service, "/v1/chat/completions", {"messages": msgs, "n": 2})[1]["error"]["param"]
        == "n"
    )
    assert (
        _post(service, "/v1/chat/completions", {"messages": msgs, "top_p": 0.5})[1]["error"][
            "param"
        ]
        == "top_p"
    )
