"""The official ``openai`` client against both apps on real Ray Serve over HTTP: chat,
streaming, n, logprobs, a wrong key, a client that leaves mid-stream, and one rate limit
shared by two replicas."""

from __future__ import annotations

import http.client
import json
import os
import time
from urllib.parse import urlsplit

import pytest
from conftest import init_store
from serve_support import TEST_KEY, http_json

pytestmark = pytest.mark.usefixtures("one_torch_thread")
openai = pytest.importorskip("openai")

PROMPT = "def add(a, b):"
ENV = {"PRIVCODE_TEST_OA_KEY": TEST_KEY, "OMP_NUM_THREADS": "1"}


def _client(url, key=TEST_KEY):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def premium_url(serve_http, premium_release):
    from ray import serve

    from privcode.serve.premium import build_app

    application = build_app(
        {
            "premium": str(premium_release),
            "device": "cpu",
            "max_tokens_limit": 64,
            "api_key_env": "PRIVCODE_TEST_OA_KEY",
            "batch_wait_timeout_s": 0.05,
        },
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": ENV}},
    )
    serve.run(application, name="premium-oa", route_prefix="/premium-oa")
    yield f"{serve_http}/premium-oa"
    serve.delete("premium-oa")


@pytest.fixture(scope="module")
def pac_url(serve_http, pac_worlds, tmp_path_factory):
    from ray import serve

    from privcode.serve.ensemble import build_app

    store = init_store(tmp_path_factory.mktemp("oa-store") / "store")
    application = build_app(
        {
            "worlds": str(pac_worlds),
            "device": "cpu",
            "max_tokens_limit": 200,
            "privacy_store": str(store),
            "api_key_env": "PRIVCODE_TEST_OA_KEY",
        },
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": ENV}},
    )
    serve.run(application, name="pac-oa", route_prefix="/pac-oa")
    yield f"{serve_http}/pac-oa"
    serve.delete("pac-oa")


def _chat(client, **kw):
    return client.chat.completions.create(
        model=kw.pop("model", None) or client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        **kw,
    )


def test_the_openai_client_on_the_premium_app(premium_url):
    client = _client(premium_url)
    model = client.models.list().data[0].id
    assert model == "privcode-premium"
    text = client.completions.create(model=model, prompt=PROMPT + "\n", max_tokens=12)
    chat = _chat(client, model=model, max_tokens=12)
    assert chat.choices[0].message.content == text.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    # streaming: the chunks joined are the greedy answer; the usage comes last
    chunks = list(
        _chat(
            client, model=model, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert joined == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    streamed = client.completions.create(
        model=model, prompt=PROMPT + "\n", max_tokens=12, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    # n = 3 sampled choices, and log-probabilities
    three = _chat(client, model=model, max_tokens=8, n=3, temperature=1.0, seed=11)
    assert [c.index for c in three.choices] == [0, 1, 2]
    lp = _chat(client, model=model, max_tokens=6, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    with pytest.raises(openai.AuthenticationError):
        _client(premium_url, key="wrong-key-0123456789abcdef0123456789").models.list()
    with pytest.raises(openai.BadRequestError):
        _chat(client, model=model, max_tokens=1000)


def test_the_openai_client_on_the_pac_app(pac_url):
    client = _client(pac_url)
    model = client.models.list().data[0].id
    assert model == "privcode-pac"
    chat = _chat(client, model=model, max_tokens=8)
    assert chat.choices[0].message.content and chat.model_extra["privacy"]["charged_nats"] >= 0
    chunks = list(_chat(client, model=model, max_tokens=8, stream=True))
    assert chunks[-1].model_extra["privacy"]["one_shot"] is True
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, stream=True)
    assert sum(1 for _ in text) >= 1
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, model=model, max_tokens=4, logprobs=True)
    assert "not what its curator releases" in str(err.value)
    with pytest.raises(openai.AuthenticationError):
        _client(pac_url, key="wrong-key-0123456789abcdef0123456789").models.list()


def test_a_pac_client_that_leaves_mid_stream_is_charged_only_for_what_was_released(pac_url):
    status, session = http_json(f"{pac_url}/v1/sessions", b"", key=TEST_KEY, method="POST")
    assert status == 200
    parts = urlsplit(pac_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "session": session["id"]}
    conn.request(
        "POST",
        f"{parts.path}/v1/completions",
        body=json.dumps(body),
        headers={"Authorization": f"Bearer {TEST_KEY}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # three token chunks, then the client goes away
        line = resp.fp.readline()
        seen += line.startswith(b"data: {")
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    info = {}
    while time.monotonic() < deadline:  # the replica notices, and its worker is free again
        info = http_json(f"{pac_url}/v1/sessions/{session['id']}", key=TEST_KEY)[1]
        released = info["private_tokens"] + info["free_tokens"] + info["fallback_tokens"]
        time.sleep(1.0)
        again = http_json(f"{pac_url}/v1/sessions/{session['id']}", key=TEST_KEY)[1]
        if again == info:
            break
    released = info["private_tokens"] + info["free_tokens"] + info["fallback_tokens"]
    assert 3 <= released < 200  # the decode stopped; it did not run to max_tokens
    assert info["charged_nats"] == pytest.approx(
        info["per_token_budget_nats"] * info["private_tokens"], rel=1e-12
    )


def test_two_replicas_share_one_rate_limit(serve_http, premium_release):
    from ray import serve

    from privcode.serve.premium import build_app

    rate, burst = 1.0, 3
    application = build_app(
        {
            "premium": str(premium_release),
            "device": "cpu",
            "api_key_env": "PRIVCODE_TEST_OA_KEY",
            "rate_limit_rps": rate,
            "rate_limit_burst": burst,
        },
        num_replicas=2,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": ENV}},
    )
    serve.run(application, name="premium-rl", route_prefix="/premium-rl")
    try:
        url = f"{serve_http}/premium-rl"
        start = time.monotonic()
        codes = [http_json(f"{url}/v1/models", key=TEST_KEY)[0] for _ in range(16)]
        elapsed = time.monotonic() - start
    finally:
        serve.delete("premium-rl")
    ok = codes.count(200)
    assert set(codes) <= {200, 429}
    # One bucket for both replicas: the burst plus the rate over the run, not twice that.
    assert burst <= ok <= burst + rate * elapsed + 1, (ok, elapsed)
    assert os.environ.get("PRIVCODE_TEST_OA_KEY") is None
