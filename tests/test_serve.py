"""The premium model's OpenAI-compatible Serve app: validation, generation, batching, HTTP."""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import premium_json
from serve_support import (
    TEST_KEY,
    asgi_call,
    fuzz_openapi,
    http_json,
    http_status_of_refused_body,
    limits,
)

from privcode.serve.api import CompletionRequest, RequestError, parse_completion
from privcode.serve.args import guard_limits
from privcode.serve.guard import GuardError, KeyRing
from privcode.serve.premium import (
    PremiumModel,
    Prepared,
    ServeError,
    app,
    build_api,
    build_app,
    parse_args,
)

MAX_BODY_BYTES = 1 << 20

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n\n\nclass Reader:\n", "# parse"]
SECRET = "SECRET-PROMPT-7f3a"


@pytest.fixture(scope="module")
def release(premium_release):
    return premium_release


@pytest.fixture(scope="module")
def premium(release):
    return PremiumModel(release, device="cpu", max_tokens_limit=64)


def _req(prompt: str, **kw) -> CompletionRequest:
    return parse_completion({"prompt": prompt, **kw}, 64)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [[1, 2]]}, "prompt"),
        ({"prompt": SECRET, "max_tokens": 0}, "max_tokens"),
        ({"prompt": SECRET, "max_tokens": 65}, "max_tokens"),
        ({"prompt": SECRET, "max_tokens": "8"}, "max_tokens"),
        ({"prompt": SECRET, "max_tokens": True}, "max_tokens"),
        ({"prompt": SECRET, "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": SECRET, "temperature": -0.1}, "temperature"),
        ({"prompt": SECRET, "temperature": 1e-300}, "temperature"),  # overflows the softmax
        ({"prompt": SECRET, "temperature": 2.5}, "temperature"),
        ({"prompt": SECRET, "n": True}, "n"),
        ({"prompt": SECRET, "temperature": "hot"}, "temperature"),
        ({"prompt": SECRET, "top_p": 0}, "top_p"),
        ({"prompt": SECRET, "top_p": 1.5}, "top_p"),
        ({"prompt": SECRET, "stop": 5}, "stop"),
        ({"prompt": SECRET, "stop": [""]}, "stop"),
        ({"prompt": SECRET, "stop": ["a", 3]}, "stop"),
        ({"prompt": SECRET, "stop": ["s"] * 17}, "stop"),
        ({"prompt": SECRET, "seed": 1.5}, "seed"),
        ({"prompt": SECRET, "seed": "7"}, "seed"),
        ({"prompt": SECRET, "seed": 1 << 64}, "seed"),
        ({"prompt": SECRET, "model": 3}, "model"),
        ({"prompt": SECRET, "n": 2}, "n"),
        ({"prompt": SECRET, "stream": "yes"}, "stream"),
        ({"prompt": SECRET, "stream": True, "stream_options": {"x": 1}}, "stream_options"),
        ({"prompt": SECRET, "logprobs": 6}, "logprobs"),
        ({"prompt": SECRET, "logprobs": True}, "logprobs"),
        ({"prompt": SECRET, "frobnicate": 1}, "frobnicate"),
    ],
)
def test_each_bad_field_is_named_and_the_prompt_is_not_echoed(body, param):
    with pytest.raises(RequestError) as err:
        parse_completion(json.dumps(body).encode(), 64)
    assert err.value.param == param and err.value.status == 400
    assert f"'{param}'" in err.value.message
    assert SECRET not in json.dumps(err.value.body())
    assert err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [b"{", b"[1]", b"\xff\xfe", b'{"prompt": NaN}', b"[" * 100_000],
)
def test_bodies_that_are_not_a_json_object_are_refused(raw):
    with pytest.raises(RequestError) as err:
        parse_completion(raw, 64)
    assert err.value.status == 400 and err.value.param is None


def test_defaults_and_the_neutral_values_standard_clients_send():
    req = parse_completion(
        json.dumps(
            {
                "prompt": ["x"],
                "model": "m",
                "n": 1,
                "stream": False,
                "echo": False,
                "logprobs": None,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "best_of": 1,
                "user": "u",
                "stop": None,
                "seed": None,
            }
        ).encode(),
        512,
    )
    assert req == CompletionRequest(
        prompt="x", max_tokens=128, temperature=0.0, top_p=1.0, stop=(), seed=None, model="m"
    )
    assert req.greedy
    req = parse_completion(
        {"prompt": "", "max_tokens": 8, "temperature": 1, "top_p": 0.5, "stop": "\n", "seed": -3}, 8
    )
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.seed) == (
        8,
        1.0,
        0.5,
        ("\n",),
        -3,
    )
    assert parse_completion({"prompt": "x"}, 16).max_tokens == 16  # default within the limit


def test_key_ring_principals_and_refusals(tmp_path):
    other = "other-key-0123456789abcdef01234567"
    ring = KeyRing({"alice": TEST_KEY, "bob": other})
    assert ring.principal(f"Bearer {TEST_KEY}") == "alice"
    assert ring.principal(f"bearer  {other} ") == "bob"
    for header in (None, "", TEST_KEY, "Bearer", f"Bearer {TEST_KEY}x", f"Basic {TEST_KEY}"):
        assert ring.principal(header) is None
    with pytest.raises(GuardError, match="at least 32 characters"):
        KeyRing({"alice": "short"})
    with pytest.raises(GuardError, match="same key"):
        KeyRing({"alice": TEST_KEY, "bob": TEST_KEY})
    # A mounted Secret: one file per client; dot entries (..data) are skipped.
    (tmp_path / "alice").write_text(TEST_KEY + "\n")
    (tmp_path / "..data").mkdir()
    loaded = KeyRing.load(str(tmp_path), env={"PRIVCODE_API_KEY": other})
    assert loaded.principals == ("alice", "default")
    with pytest.raises(GuardError, match="--insecure-no-auth"):
        KeyRing.load(None, env={})  # no key: refuse to start
    assert KeyRing.load(None, insecure=True, env={}).principal(None) == "anonymous"


# --------------------------------------------------------------------------- args


@pytest.mark.parametrize(
    "args, key",
    [
        ({}, "premium"),
        ({"premium": ""}, "premium"),
        ({"premium": "/r", "devcie": "cpu"}, "devcie"),
        ({"premium": "/r", "device": "gpu"}, "device"),
        ({"premium": "/r", "model": ""}, "model"),
        ({"premium": "/r", "max_tokens_limit": 0}, "max_tokens_limit"),
        ({"premium": "/r", "max_tokens_limit": "512"}, "max_tokens_limit"),
        ({"premium": "/r", "max_batch_size": True}, "max_batch_size"),
        ({"premium": "/r", "batch_wait_timeout_s": -1}, "batch_wait_timeout_s"),
        ({"premium": "/r", "api_key_env": "1-BAD"}, "api_key_env"),
        ({"premium": "/r", "served_model_name": 3}, "served_model_name"),
    ],
)
def test_bad_app_args_name_the_key(args, key):
    with pytest.raises(ServeError, match=f"'{key}'"):
        parse_args(args)
    with pytest.raises(ServeError, match=f"'{key}'"):
        app(args)


def test_app_args_defaults_and_builder(monkeypatch):
    from ray import serve

    cfg = parse_args({"premium": "/r", "max_batch_size": 32})
    assert (
        cfg.model,
        cfg.device,
        cfg.max_tokens_limit,
        cfg.batch_wait_timeout_s,
        cfg.api_key_env,
        cfg.insecure_no_auth,
    ) == (None, "auto", 512, 0.02, "PRIVCODE_API_KEY", False)
    with pytest.raises(ServeError, match="mapping"):
        parse_args(["premium"])
    monkeypatch.delenv("PRIVCODE_API_KEY", raising=False)
    monkeypatch.delenv("PRIVCODE_API_KEYS_DIR", raising=False)
    with pytest.raises(ServeError, match="no API key"):  # a default-open replica does not start
        guard_limits(parse_args({"premium": "/r"}), ServeError)
    assert guard_limits(parse_args({"premium": "/r", "insecure_no_auth": True}), ServeError)
    monkeypatch.setenv("PRIVCODE_API_KEY", TEST_KEY)
    assert guard_limits(parse_args({"premium": "/r"}), ServeError).keys.principals == ("default",)
    assert isinstance(app({"premium": "/r"}), serve.Application)  # no Ray needed to build
    assert isinstance(build_app({"premium": "/r"}, num_replicas=2), serve.Application)


def test_a_missing_release_or_base_model_is_a_clear_error(release, tmp_path):
    with pytest.raises(ServeError, match="no premium.json"):
        PremiumModel(tmp_path)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "adapter").symlink_to(release / "adapter")
    (moved / "premium.json").write_text(premium_json(tmp_path / "gone"))
    with pytest.raises(ServeError, match="pass its path as the 'model' arg"):
        PremiumModel(moved, device="cpu")
    base = json.loads((release / "premium.json").read_text())["model"]
    assert PremiumModel(moved, model=base, device="cpu").base == base  # the override


# --------------------------------------------------------------------------- generation


def test_the_adapter_is_merged_into_the_served_weights(release, premium):
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm

    base = json.loads((release / "premium.json").read_text())["model"]
    ids = torch.tensor([premium.prepare(_req(PROMPTS[0])).ids])
    with torch.inference_mode():
        served = premium.model(input_ids=ids).logits
        plain = load_causal_lm(base)(input_ids=ids).logits
        peft = PeftModel.from_pretrained(load_causal_lm(base), str(release / "adapter"))
        adapted = peft(input_ids=ids).logits
    assert torch.allclose(served, adapted, atol=1e-4)
    assert not torch.allclose(served, plain, atol=1e-2)  # the adapter changes the model


def test_greedy_completion_equals_generate_by_hand(release, premium):
    from peft import PeftModel

    from privcode.models.loading import load_causal_lm, load_tokenizer

    base = json.loads((release / "premium.json").read_text())["model"]
    tok = load_tokenizer(base)
    model = PeftModel.from_pretrained(
        load_causal_lm(base), str(release / "adapter")
    ).merge_and_unload()
    enc = tok(PROMPTS[0], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=16, pad_token_id=tok.pad_token_id
        )
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id) + 1]
    expected = tok.decode(new, skip_special_tokens=True)
    got = premium.complete(_req(PROMPTS[0], max_tokens=16))
    assert got.text == expected and got.text.strip()
    assert got.completion_tokens == len(new)
    assert got.prompt_tokens == enc["input_ids"].shape[1]
    assert got.finish_reason == ("stop" if tok.eos_token_id in new else "length")


def test_a_batch_returns_each_prompt_its_own_greedy_completion(premium):
    reqs = [_req(p, max_tokens=n) for p, n in zip(PROMPTS, (12, 20, 7), strict=True)]
    alone = [premium.complete(r) for r in reqs]
    batched = premium.generate_batch([premium.prepare(r) for r in reqs])
    assert batched == alone
    assert len({c.text for c in alone}) == 3
    assert len({c.prompt_tokens for c in alone}) == 3  # left padding is exercised
    # Mixed settings in one batch: the greedy ones still get their own results.
    mixed = premium.generate_batch(
        [
            premium.prepare(r)
            for r in (reqs[0], _req(PROMPTS[1], temperature=1.0, max_tokens=8), reqs[2])
        ]
    )
    assert mixed[0] == alone[0] and mixed[2] == alone[2]


def test_stop_strings_truncate_and_finish_with_stop(premium):
    # The first prompt whose greedy completion runs to the token limit (the random
    # adapter's EOS may come early on one of them).
    prompt, full = next(
        (p, c)
        for p in PROMPTS
        if (c := premium.complete(_req(p, max_tokens=24))).finish_reason == "length"
    )
    assert full.completion_tokens == 24 and len(full.text) >= 6
    k = len(full.text) // 2
    stop = full.text[k : k + 3]
    got = premium.complete(_req(prompt, max_tokens=24, stop=["\x00never", stop]))
    assert got.text == full.text[: full.text.find(stop)]
    assert got.finish_reason == "stop" and got.completion_tokens < 24  # stopped early


def test_eos_finishes_with_stop_and_counts_the_eos_token(premium):
    from privcode.models.generate import _finish  # how generate ends each of serve's rows

    tok, eos_ids = premium.tokenizer, premium.eos_ids
    words = tok("x = 1", add_special_tokens=False)["input_ids"]
    got = _finish(tok, [*words, eos_ids[0], premium.pad_id, premium.pad_id], 10, eos_ids, ())
    assert (got.text, got.finish_reason, got.completion_tokens) == ("x = 1", "stop", len(words) + 1)
    got = _finish(tok, [*words] * 5, 10, eos_ids, ())
    assert got.finish_reason == "length" and got.completion_tokens == 10


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(premium):
    req = _req(PROMPTS[2], temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    first = premium.complete(req)
    assert premium.complete(req) == first
    batch = premium.generate_batch(
        [
            premium.prepare(r)
            for r in (_req(PROMPTS[0], temperature=1.0, max_tokens=16), req, _req(PROMPTS[1]))
        ]
    )
    assert batch[1] == first
    others = {
        premium.complete(_req(PROMPTS[2], temperature=1.0, top_p=0.95, seed=s, max_tokens=16)).text
        for s in range(1, 4)
    }
    assert others - {first.text}  # the seed matters


def test_a_mixed_batch_is_one_generate_call(premium, monkeypatch):
    """Greedy, sampled and seeded requests share one generate (a seeded request used to run
    alone, serialising its batch); greedy rows answer as they do alone."""
    reqs = [
        _req(PROMPTS[0], max_tokens=8),
        _req(PROMPTS[1], temperature=0.7, top_p=0.9, max_tokens=8),
        _req(PROMPTS[2], temperature=1.0, seed=7, max_tokens=8),
        _req(PROMPTS[0], temperature=1.3, seed=8, max_tokens=8),
    ]
    alone = premium.complete(reqs[0])
    calls = []
    generate = premium.model.generate
    monkeypatch.setattr(premium.model, "generate", lambda **kw: calls.append(1) or generate(**kw))
    out = premium.generate_batch([premium.prepare(r) for r in reqs])
    assert len(calls) == 1 and not [o for o in out if isinstance(o, Exception)]
    assert out[0] == alone


def test_row_sampler_draws_from_the_tempered_nucleus():
    """RowSampler's draws against an independent NumPy reference of softmax(s / t) cut to the
    top-p nucleus (HF's rule: drop tokens whose ascending cumulative mass is <= 1 - p)."""
    import numpy as np

    from privcode.models.sampling import RowSampler

    scores = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, -3.0]])
    t, p = 0.7, 0.9
    z = np.exp(scores[0].numpy() / t - (scores[0].numpy() / t).max())
    probs = z / z.sum()
    order = np.argsort(probs)
    drop = order[np.cumsum(probs[order]) <= 1 - p]
    ref = probs.copy()
    ref[drop] = 0
    ref /= ref.sum()
    gen = torch.Generator().manual_seed(0)
    sampler = RowSampler([(t, p, gen)])
    n = 20_000
    draws = [int(sampler(None, scores).argmax()) for _ in range(n)]
    freq = np.bincount(draws, minlength=6) / n
    assert np.all(freq[ref == 0] == 0)
    assert np.abs(freq - ref).max() < 4 * np.sqrt(0.25 / n)  # 4 sigma
    greedy = RowSampler([(0.0, 1.0, None)])(None, scores)
    assert torch.equal(greedy, scores)


def test_prompts_beyond_the_context_are_refused_without_echo(premium):
    long_prompt = SECRET + " ".join(str(i) for i in range(2 * premium.context))
    with pytest.raises(RequestError) as err:
        premium.prepare(_req(long_prompt))
    assert err.value.param == "prompt" and SECRET not in err.value.message
    ids = premium.tokenizer(long_prompt)["input_ids"][: premium.context - 20]
    fits = premium.tokenizer.decode(ids)
    assert len(premium.prepare(_req(fits, max_tokens=1)).ids) < premium.context - 1
    with pytest.raises(RequestError) as err:
        premium.prepare(_req(fits, max_tokens=64))
    assert err.value.param == "max_tokens"
    assert premium.complete(_req("", max_tokens=3)).completion_tokens >= 1  # empty prompt: BOS


# --------------------------------------------------------------------------- API (no Ray)


def _call(api, method, path, body=None, key=TEST_KEY):
    return asgi_call(api, method, path, body, key=key)


def _api(premium, **kw):
    async def generate(item):
        result = premium.generate_batch([item])[0]
        if isinstance(result, Exception):
            raise result
        return result

    return build_api(premium, generate, limits(**kw))


def test_api_routes_errors_and_response_format(premium, caplog):
    api = _api(premium)
    caplog.set_level(logging.INFO, logger="privcode.serve")
    status, body, _ = _call(
        api, "POST", "/v1/completions", {"prompt": PROMPTS[0] + "# " + SECRET, "max_tokens": 5}
    )
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "privcode-premium"
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 or choice["finish_reason"] == "stop"
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "completion: prompt_tokens=" in caplog.text
    assert SECRET not in caplog.text  # prompts are never logged
    assert _call(api, "GET", "/v1/models")[1] == {
        "object": "list",
        "data": [
            {
                "id": "privcode-premium",
                "object": "model",
                "created": premium.created,
                "owned_by": "privcode",
            }
        ],
    }
    assert _call(api, "GET", "/v1/models/privcode-premium")[0] == 200
    assert _call(api, "GET", "/v1/models/other")[0] == 404
    assert _call(api, "GET", "/healthz")[:2] == (200, {"status": "ok"})
    status, body, _ = _call(api, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body, _ = _call(api, "POST", "/v1/chat/completions", {"prompt": "x"})
    assert status == 400 and body["error"]["param"] == "messages"  # chat takes messages
    status, _, headers = _call(api, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "x", "top_p": 2})
    assert status == 400 and body["error"]["param"] == "top_p"
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body, _ = _call(api, "POST", "/v1/completions", b"not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_api_key_is_required_except_on_healthz(premium):
    api = _api(premium)
    for key in (None, "wrong"):
        status, body, headers = _call(api, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"] == "Bearer"
        assert _call(api, "POST", "/v1/completions", {"prompt": "x"}, key=key)[0] == 401
        assert _call(api, "GET", "/openapi.json", key=key)[0] == 401
    assert _call(api, "GET", "/v1/models")[0] == 200
    assert _call(api, "GET", "/healthz", key=None)[0] == 200
    # Served without keys only when asked for by name, and every answer says so.
    open_api = _api(premium, key=None)
    status, _, headers = _call(open_api, "GET", "/v1/models", key=None)
    assert status == 200 and "unauthenticated" in headers["x-privcode-warning"]


def test_openapi_schema_states_the_limits(premium):
    status, schema, _ = _call(_api(premium), "GET", "/openapi.json")
    assert status == 200 and "/v1/completions" in schema["paths"]
    body = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    bounds = [b for b in body["max_tokens"]["anyOf"] if b.get("type") == "integer"][0]
    assert (bounds["minimum"], bounds["maximum"]) == (1, premium.max_tokens_limit)
    assert body["temperature"]["anyOf"][:2] == [
        {"type": "number", "minimum": 0, "maximum": 0},
        {"type": "number", "minimum": 0.01, "maximum": 2.0},
    ]


def test_input_limits_over_http(premium, caplog):
    """The review's inputs: a 1e-300 temperature (was a 500 for its whole batch), a 1 MB
    prompt (refused before tokenisation), an oversized body (413, not 400)."""
    api = _api(premium, max_body_bytes=64 * 1024)
    caplog.set_level(logging.INFO)
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "x", "temperature": 1e-300})
    assert status == 400 and body["error"]["param"] == "temperature"
    big = _api(premium, max_body_bytes=4 << 20)
    huge = SECRET + "x" * (1 << 20)
    status, body, _ = _call(big, "POST", "/v1/completions", {"prompt": huge, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "characters" in body["error"]["message"] and SECRET not in json.dumps(body)
    status, body, _ = _call(api, "POST", "/v1/completions", b"x" * (64 * 1024 + 1))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert SECRET not in caplog.text


def test_rate_limit_per_key_with_retry_after(premium):
    api = _api(premium, rps=0.5, burst=2, other="other-key-0123456789abcdef01234567")
    assert [_call(api, "GET", "/v1/models")[0] for _ in range(2)] == [200, 200]
    status, body, headers = _call(api, "GET", "/v1/models")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 2
    # Another key has its own bucket; /healthz is never limited.
    assert _call(api, "GET", "/v1/models", key="other-key-0123456789abcdef01234567")[0] == 200
    assert _call(api, "GET", "/healthz", key=None)[0] == 200


# --------------------------------------------------------------------------- Ray Serve


def test_serve_app_overhttp_json(serve_http, release, premium):
    from ray import serve

    key = TEST_KEY
    expected = [premium.complete(_req(p, max_tokens=12)).text for p in PROMPTS]
    try:
        application = build_app(
            {
                "premium": str(release),
                "device": "cpu",
                "max_tokens_limit": 64,
                "api_key_env": "PRIVCODE_TEST_SERVE_KEY",
                "batch_wait_timeout_s": 0.2,
            },
            ray_actor_options={
                "num_cpus": 1,
                "runtime_env": {
                    "env_vars": {"PRIVCODE_TEST_SERVE_KEY": key, "OMP_NUM_THREADS": "1"}
                },
            },
        )
        serve.run(application, name="premium-test", route_prefix="/premium")
        url = f"{serve_http}/premium"
        assert http_json(f"{url}/healthz") == (200, {"status": "ok"})
        completion = {"prompt": PROMPTS[0], "max_tokens": 12}
        for bad_key in (None, "wrong-key"):
            status, body = http_json(f"{url}/v1/completions", completion, key=bad_key)
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = http_json(f"{url}/v1/completions", completion, key=key)
        assert status == 200 and body["choices"][0]["text"] == expected[0]
        with ThreadPoolExecutor(3) as pool:  # concurrent requests share a batch
            answers = list(
                pool.map(
                    lambda p: http_json(
                        f"{url}/v1/completions", {"prompt": p, "max_tokens": 12}, key=key
                    ),
                    PROMPTS,
                )
            )
        assert [a[1]["choices"][0]["text"] for a in answers] == expected
        status, body = http_json(
            f"{url}/v1/completions", {"prompt": "x", "max_tokens": 65}, key=key
        )
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = http_json(f"{url}/v1/models", key=key)
        assert status == 200 and body["data"][0]["id"] == "privcode-premium"
        assert http_json(f"{url}/v1/nope", key=key)[0] == 404
        assert http_json(f"{url}/v1/completions", key=key)[0] == 405
        assert (
            http_status_of_refused_body(
                f"{url}/v1/completions", b"x" * (MAX_BODY_BYTES + 10), key=key
            )
            == 413
        )
        # Stage II's endpoint extractor/summariser (synth.llm_endpoint) on this very app:
        # its answers are the premium model's greedy completions of the filter's prompts.
        from privcode.synth.llm_endpoint import EndpointGenerator

        os.environ["PRIVCODE_TEST_LLM_KEY"] = key
        gen = EndpointGenerator(
            url, api_key_env="PRIVCODE_TEST_LLM_KEY", max_new_tokens=12, concurrency=3
        )
        asks = [gen.format("Summarise this code.", p, "Summary") for p in PROMPTS]
        assert gen.generate(asks) == [premium.complete(_req(a, max_tokens=12)).text for a in asks]
    finally:
        os.environ.pop("PRIVCODE_TEST_LLM_KEY", None)
        serve.delete("premium-test")
    assert os.environ.get("PRIVCODE_TEST_SERVE_KEY") is None  # the key stayed on the replica


# --------------------------------------------------------------------------- fuzz


@pytest.mark.heavy
def test_openapi_fuzz_premium(premium):
    ops = fuzz_openapi(_api(premium))
    assert "POST /v1/completions" in ops and "GET /v1/models/{model_id}" in ops
    assert "POST /v1/chat/completions" in ops


def test_privcode_serve_refuses_an_open_app_before_starting_anything(
    release, monkeypatch, tmp_path, capsys
):
    """No key: `privcode serve` stops before connecting to Ray, naming how to add one; and
    --insecure-no-auth binds loopback only."""
    from privcode.cli import main

    monkeypatch.delenv("PRIVCODE_API_KEY", raising=False)
    monkeypatch.delenv("PRIVCODE_API_KEYS_DIR", raising=False)
    monkeypatch.setattr(
        "privcode.cluster.local.connect", lambda *a, **k: pytest.fail("connected to Ray")
    )
    args = ["serve", "--premium", str(release), "--set", f"run.out_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "no API key" in err and "--insecure-no-auth" in err
    assert main([*args, "--insecure-no-auth", "--host", "0.0.0.0"]) == 2
    assert "127.0.0.1" in capsys.readouterr().err


def test_the_cli_hands_its_key_to_the_replicas_in_a_private_directory(monkeypatch):
    """`make serve`'s replicas run in the head's processes, not under this shell: the CLI
    writes $PRIVCODE_API_KEY to a 0700 directory for them (never into the Serve config)."""
    import stat
    from pathlib import Path

    from privcode.serve.cli import _keys_dir_for_replicas

    monkeypatch.setenv("PRIVCODE_API_KEY", TEST_KEY)
    monkeypatch.delenv("PRIVCODE_API_KEYS_DIR", raising=False)
    folder = Path(_keys_dir_for_replicas({"api_keys_dir": None}))
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "default").stat().st_mode) == 0o600
        # The replica reads the directory; the same key in its env too is one client.
        ring = KeyRing.load(str(folder), env={"PRIVCODE_API_KEY": TEST_KEY})
        assert ring.principals == ("default",) and ring.principal(f"Bearer {TEST_KEY}")
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    assert _keys_dir_for_replicas({"api_keys_dir": "/keys"}) is None  # configured: left alone


def test_an_unexpected_error_is_a_500_that_names_nothing(caplog):
    """A failure inside generation: 500, logged by its type only (the message could hold the
    prompt); refusals the app raises on purpose keep their own status."""

    class Boom(Exception):
        pass

    class Model:
        name, created, max_tokens_limit, max_prompt_chars = "m", 1, 8, 100
        tokenizer, eos_ids = None, ()

        def prepare(self, request):
            if request.prompt == "refuse":
                raise RequestError("'prompt' is refused", "prompt")
            return Prepared(request, (1,))

    async def generate(item):
        raise Boom(f"failed on {item.request.prompt}")

    api = build_api(Model(), generate, limits())
    caplog.set_level(logging.INFO)
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": SECRET})
    assert status == 500 and body["error"]["type"] == "server_error"
    assert SECRET not in json.dumps(body) and SECRET not in caplog.text
    assert "request failed: Boom" in caplog.text
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "refuse"})
    assert status == 400 and body["error"]["param"] == "prompt"


def test_a_release_without_a_dp_guarantee_is_not_served_unless_named(tmp_path, caplog):
    """issue 42 point 3: a premium release whose premium.json says dp: false (tuned on data
    not synthesised from a DP release) is refused by the app, on every engine, unless
    serve_non_dp_release names the risk; then each replica logs that it is NOT PRIVATE."""
    from conftest import premium_json

    from privcode.serve.premium import ServeError, check_release_privacy, parse_args

    dp, no_dp = tmp_path / "dp", tmp_path / "no-dp"
    for root, flag in ((dp, True), (no_dp, False)):
        root.mkdir()
        (root / "premium.json").write_text(premium_json("/base", dp=flag))
    check_release_privacy(parse_args({"premium": str(dp), "insecure_no_auth": True}))
    with pytest.raises(ServeError, match="NO differential-privacy guarantee"):
        check_release_privacy(parse_args({"premium": str(no_dp), "insecure_no_auth": True}))
    named = {"premium": str(no_dp), "insecure_no_auth": True, "serve_non_dp_release": True}
    check_release_privacy(parse_args(named))
    assert "NOT PRIVATE" in caplog.text
    from privcode.serve.premium_llm import model_source

    with pytest.raises(ServeError, match="NO differential-privacy guarantee"):
        model_source(parse_args({"premium": str(no_dp), "insecure_no_auth": True}))
