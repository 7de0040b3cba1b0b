"""The premium model's OpenAI-compatible Serve app: validation, generation, batching, HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import premium_json
from serve_support import http_json, http_status_of_refused_body

from privcode.config import BaseConfig
from privcode.serve.http import (
    MAX_BODY_BYTES,
    CompletionRequest,
    CompletionsAPI,
    RequestError,
    bearer_ok,
    parse_completion,
    route_path,
)
from privcode.serve.premium import (
    Completion,
    PremiumModel,
    ServeError,
    api_key_from_env,
    app,
    build_app,
    parse_args,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["def add(a, b):\n", "import os\nimport sys\n\n\nclass Reader:\n", "# parse"]
SECRET = "SECRET-PROMPT-7f3a"


@pytest.fixture(scope="module")
def release(ci_base_cache, tmp_path_factory):
    """A premium-style release: a LoRA adapter + premium.json.

    The adapter's B matrices are large random values, so the adapter dominates
    the tiny base model: completions are varied, non-blank token soup whatever
    the base model learnt (a busy machine can stop its training early).
    """
    from privcode.models.base import build_base
    from privcode.models.loading import attach_lora, load_causal_lm

    base = build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]
    root = tmp_path_factory.mktemp("premium")
    with torch.random.fork_rng():  # LoRA's A matrices: not from what earlier tests drew
        torch.manual_seed(0)
        model = attach_lora(load_causal_lm(base), r=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(root / "adapter"))
    (root / "premium.json").write_text(premium_json(base), encoding="utf-8")
    return root


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
        ({"prompt": SECRET, "stream": True}, "stream"),
        ({"prompt": SECRET, "logprobs": 5}, "logprobs"),
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
    [b"{", b"[1]", b"\xff\xfe", b'{"prompt": NaN}', b"[" * 100_000, b" " * (MAX_BODY_BYTES + 1)],
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


def test_bearer_tokens_and_route_paths():
    assert bearer_ok("Bearer k3y", "k3y") and bearer_ok("bearer  k3y ", "k3y")
    for header in (None, "", "k3y", "Bearer", "Bearer k3", "Basic k3y", "Bearer k3yy"):
        assert not bearer_ok(header, "k3y")
    assert route_path({"path": "/premium/v1/models/", "root_path": "/premium"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": "/premium"}) == "/v1/models"
    assert route_path({"path": "/premium", "root_path": "/premium"}) == "/"
    assert route_path({"path": "/healthz", "root_path": ""}) == "/healthz"


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


def test_app_args_defaults_and_builder():
    from ray import serve

    cfg = parse_args({"premium": "/r", "max_batch_size": 32})
    assert (
        cfg.model,
        cfg.device,
        cfg.max_tokens_limit,
        cfg.batch_wait_timeout_s,
        cfg.api_key_env,
    ) == (None, "auto", 512, 0.02, "PRIVCODE_API_KEY")
    with pytest.raises(ServeError, match="mapping"):
        parse_args(["premium"])
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
    item = premium.prepare(_req(PROMPTS[0], max_tokens=10))
    words = premium.tokenizer("x = 1", add_special_tokens=False)["input_ids"]
    eos = premium.eos_ids[0]
    got = premium._finish(item, [*words, eos, premium.pad_id, premium.pad_id], None)
    assert got == Completion("x = 1", "stop", len(item.ids), len(words) + 1)
    got = premium._finish(item, [*words] * 5, None)
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


def _call(api, method, path, body=None, key=None):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    raw = body if isinstance(body, bytes) else json.dumps(body or {}).encode()

    async def read():
        return raw

    return asyncio.run(api.handle(method, path, headers, read))


def _api(premium, key=None):
    async def generate(item):
        result = premium.generate_batch([item])[0]
        if isinstance(result, Exception):
            raise result
        return result

    return CompletionsAPI(premium, generate, key)


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
    status, body, _ = _call(api, "POST", "/v1/chat/completions", {"prompt": "x"})
    assert status == 404 and body["error"]["code"] == "not_found"
    status, _, headers = _call(api, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "x", "top_p": 2})
    assert status == 400 and body["error"]["param"] == "top_p"
    status, body, _ = _call(api, "POST", "/v1/completions", {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body, _ = _call(api, "POST", "/v1/completions", b"not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_api_key_is_required_except_on_healthz(premium, caplog, monkeypatch):
    api = _api(premium, key="s3cret")
    for key in (None, "wrong"):
        status, body, headers = _call(api, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"] == "Bearer"
        assert _call(api, "POST", "/v1/completions", {"prompt": "x"}, key=key)[0] == 401
    assert _call(api, "GET", "/v1/models", key="s3cret")[0] == 200
    assert _call(api, "GET", "/healthz")[0] == 200
    monkeypatch.setenv("PC_TEST_KEY", "")
    with caplog.at_level(logging.WARNING, logger="privcode.serve"):
        assert api_key_from_env("PC_TEST_KEY") is None
    assert "UNAUTHENTICATED" in caplog.text and "$PC_TEST_KEY" in caplog.text
    monkeypatch.setenv("PC_TEST_KEY", "k")
    assert api_key_from_env("PC_TEST_KEY") == "k"


# --------------------------------------------------------------------------- Ray Serve


def test_serve_app_overhttp_json(serve_http, release, premium):
    from ray import serve

    key = "test-key-0123"
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
            == 400
        )
    finally:
        serve.delete("premium-test")
    assert os.environ.get("PRIVCODE_TEST_SERVE_KEY") is None  # the key stayed on the replica
