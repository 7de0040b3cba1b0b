"""The premium model's vLLM engine (``serve.engine: vllm``), checked without a GPU.

What runs here: the merged checkpoint vLLM loads (against the transformers engine's model),
the app args and Ray Serve LLM's ``LLMConfig`` built and validated without starting it, the
request and answer mapping, and the guarded ingress on real Ray Serve over HTTP in front of a
stand-in for the vLLM deployment (same ``complete`` contract as
:class:`privcode.serve.vllm_server.PrivcodeLLMServer`): the same routes, keys, limits and
greedy text as the transformers engine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil

import pytest
import torch
from serve_support import TEST_KEY, http_json

from privcode.config.serve import ServeConfig
from privcode.models.artifacts import MERGED_DIR, MERGED_MARKER, export_merged
from privcode.serve.api import RequestError, parse_completion
from privcode.serve.args import premium_args
from privcode.serve.premium import Completion, PremiumModel, ServeError, parse_args
from privcode.serve.premium import build_app as build_premium_app
from privcode.serve.premium_llm import (
    EngineFront,
    PremiumLLMServer,
    completion_from,
    engine_payload,
    llm_config,
    model_source,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "def add(a, b):\n"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _vllm_args(release, **more):
    serve = dataclasses.replace(ServeConfig(), engine="vllm")
    return {**premium_args(serve, str(release)), "api_key_env": "PRIVCODE_TEST_SERVE_KEY", **more}


@pytest.fixture
def release_copy(premium_release, tmp_path):
    """The session's premium release, copied: these tests write merged/ into it."""
    return shutil.copytree(premium_release, tmp_path / "premium")


# --------------------------------------------------------------------------- merged checkpoint


def test_the_merged_checkpoint_is_the_served_premium_model(release_copy, monkeypatch):
    from privcode.models.loading import load_causal_lm

    merged = export_merged(release_copy, dtype="float32")
    assert merged == (release_copy / MERGED_DIR).resolve()
    served = PremiumModel(release_copy, device="cpu")  # base + adapter, merged on load
    ids = torch.tensor([served.prepare(parse_completion({"prompt": PROMPT}, 64)).ids])
    with torch.inference_mode():
        want = served.model(ids).logits
        got = load_causal_lm(merged)(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    marker = json.loads((merged / MERGED_MARKER).read_text())
    from privcode.artifacts.premium import PremiumRecord

    premium = PremiumRecord.read(release_copy / PremiumRecord.FILE).to_json()
    assert marker["privacy"] == premium["privacy"] and marker["privacy"]["dp"] is True
    assert marker["dtype"] == "float32"
    assert (
        served.tokenizer(PROMPT)["input_ids"]
        == EngineFront(parse_args(_vllm_args(release_copy)), str(merged)).tokenizer(PROMPT)[
            "input_ids"
        ]
    )

    # Again in bfloat16 (the default): the new checkpoint replaces the old one whole.
    export_merged(release_copy)
    config = json.loads((merged / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    # A failure half-way leaves the complete checkpoint and no temporary directory.
    import transformers

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        export_merged(release_copy, dtype="float32")
    config = json.loads((merged / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert sorted(p.name for p in release_copy.iterdir()) == ["adapter", MERGED_DIR, "premium.json"]


# --------------------------------------------------------------------------- args and config


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"engine": "transformers", "vllm_dtype": "float16"}, "'vllm_dtype' needs 'engine'"),
        ({"vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization"),
        ({"vllm_lora_store": "/mnt/artifacts/adapters"}, "vllm_lora_store"),
        ({"vllm_min_replicas": 3, "vllm_max_replicas": 2}, "vllm_min_replicas"),
        ({"vllm_dtype": "float64"}, "vllm_dtype"),
        ({"engine": "tgi"}, "engine"),
    ],
)
def test_bad_vllm_args_name_the_key(args, named):
    with pytest.raises(ServeError, match=named):
        parse_args({**_vllm_args("/x"), **args})


def test_the_serve_section_refuses_min_above_max_replicas():
    from privcode.config import load_config
    from privcode.errors import ConfigError

    with pytest.raises(ConfigError, match="vllm_min_replicas"):
        load_config(overrides=["serve.vllm_min_replicas=2", "serve.vllm_max_replicas=1"])


def test_llm_config_is_built_and_validated_without_starting_vllm(premium_release):
    cfg = parse_args(
        _vllm_args(
            premium_release,
            vllm_tensor_parallel_size=2,
            vllm_gpu_memory_utilization=0.8,
            vllm_max_model_len=8192,
            vllm_min_replicas=0,
            vllm_max_replicas=4,
            vllm_accelerator_type="H100",
        )
    )
    config = llm_config(cfg, "/mnt/artifacts/premium/merged")
    assert type(config).__module__.startswith("ray.llm")
    assert config.model_id == "privcode-premium"
    assert config.model_loading_config.model_source == "/mnt/artifacts/premium/merged"
    assert config.engine_kwargs == {
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.8,
        "dtype": "auto",
        "max_model_len": 8192,
    }
    assert config.accelerator_type == "H100" and config.lora_config is None
    scaling = config.deployment_config["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["initial_replicas"]) == (
        0,
        4,
        1,
    )
    assert config.runtime_env["env_vars"]["VLLM_NO_USAGE_STATS"] == "1"
    # It survives the trip through a Serve config (what the controller deserialises).
    assert type(config).model_validate(config.model_dump()).engine_kwargs == config.engine_kwargs

    # Multi-LoRA: vLLM serves the base; the premium adapter is a multiplexed LoRA id.
    lora = parse_args(_vllm_args(premium_release, vllm_lora_store="s3://bucket/adapters/"))
    assert model_source(lora) == json.loads((premium_release / "premium.json").read_text())["model"]
    config = llm_config(lora, model_source(lora))
    assert config.model_id == "privcode-premium-base"
    assert config.lora_config.dynamic_lora_loading_path == "s3://bucket/adapters"
    assert config.engine_kwargs["enable_lora"] is True
    assert config.engine_kwargs["max_lora_rank"] == 8  # the test adapter has r = 4
    with pytest.raises(ServeError, match="accelerator type"):
        llm_config(dataclasses.replace(cfg, vllm_accelerator_type="Z9"), "/m")


def test_without_merged_weights_or_vllm_the_app_says_what_to_do(release_copy, monkeypatch):
    cfg = parse_args(_vllm_args(release_copy))
    with pytest.raises(ServeError, match="no merged/ checkpoint"):
        model_source(cfg, merge=False)
    assert model_source(cfg) == str((release_copy / MERGED_DIR).resolve())  # merged here
    assert (release_copy / MERGED_DIR / "model.safetensors").is_file()
    if not HAS_VLLM:
        monkeypatch.setenv("PRIVCODE_TEST_SERVE_KEY", TEST_KEY)
        with pytest.raises(ServeError, match=r"pip install 'privcode\[vllm\]'"):
            build_premium_app(_vllm_args(release_copy))


# --------------------------------------------------------------------------- requests


def _prepared(front_like_ids=(5, 6, 7), **body):
    from privcode.serve.premium import Prepared

    return Prepared(parse_completion({"prompt": "x", **body}, 64), tuple(front_like_ids))


def test_requests_reach_vllm_as_checked_token_ids():
    greedy = engine_payload(_prepared(max_tokens=9, stop=["\n\n", "\n\n"]), "m")
    assert greedy == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 1.0,
        "n": 1,
        "stream": False,
        "stop": ["\n\n"],
    }
    seeded = engine_payload(_prepared(temperature=0.7, top_p=0.9, seed=-1), "m")
    assert seeded["seed"] == (1 << 63) - 1 and seeded["temperature"] == 0.7
    assert "seed" not in engine_payload(_prepared(seed=3), "m")  # greedy: no seed needed


def test_vllm_answers_and_errors_map_to_the_api():
    answer = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "return a + b", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
    }
    assert completion_from(answer, 3) == Completion("return a + b", "length", 3, 9)
    answer["choices"][0]["finish_reason"] = "abort"
    assert completion_from(answer, 3).finish_reason == "stop"
    leaky = "Message: prompt 'SECRET' is too long"
    for code, status in ((400, 400), (500, 500), (503, 503), (0, 500)):
        with pytest.raises(RequestError) as err:
            completion_from({"error": {"code": code, "message": leaky, "type": "X"}}, 3)
        assert err.value.status == status and "SECRET" not in err.value.message


# --------------------------------------------------------------------------- Ray Serve


def test_the_vllm_ingress_serves_the_same_api_over_http(serve_http, release_copy):
    """The guarded ingress + a stand-in engine answering as vLLM would (greedy HF generate on
    the merged checkpoint): the transformers engine's text, keys, limits and routes."""
    from ray import serve

    merged = export_merged(release_copy, dtype="float32")
    here = PremiumModel(release_copy, device="cpu")
    expected = here.complete(parse_completion({"prompt": PROMPT, "max_tokens": 12}, 64))
    chat_prompt = here.chat_prompt([{"role": "user", "content": PROMPT}])
    expected_chat = here.complete(parse_completion({"prompt": chat_prompt, "max_tokens": 12}, 64))

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class StandInVLLM:
        def __init__(self, path: str):
            from privcode.models.loading import load_causal_lm, load_tokenizer

            self.model, self.tok = load_causal_lm(path), load_tokenizer(path)

        async def complete(self, payload: dict) -> dict:
            if payload["max_tokens"] == 13:  # an engine failure, with a prompt in its message
                return {"error": {"code": 500, "message": f"boom {payload['prompt']}"}}
            new, stop, n = self._greedy(payload)
            return {
                "choices": [
                    {
                        "text": self.tok.decode(new, skip_special_tokens=True),
                        "finish_reason": "stop" if stop else "length",
                    }
                ],
                "usage": {"prompt_tokens": n, "completion_tokens": len(new) + stop},
            }

        async def stream(self, payload: dict):
            """vLLM's chunks: a text delta per token, the finish reason, then the usage."""
            assert payload["stream"] and payload["stream_options"] == {"include_usage": True}
            new, stop, n = self._greedy(payload)
            sent = ""
            for k in range(1, len(new) + 1):
                text = self.tok.decode(new[:k], skip_special_tokens=True)
                if text.endswith("\ufffd"):
                    continue
                yield {"choices": [{"text": text[len(sent) :], "finish_reason": None}]}
                sent = text
            reason = "stop" if stop else "length"
            rest = self.tok.decode(new, skip_special_tokens=True)[len(sent) :]
            yield {"choices": [{"text": rest, "finish_reason": reason}]}
            usage = {"prompt_tokens": n, "completion_tokens": len(new) + stop}
            yield {"choices": [], "usage": usage}

        def _greedy(self, payload: dict):
            ids = torch.tensor([payload["prompt"]])
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=payload["max_tokens"],
                    do_sample=False,
                    pad_token_id=self.tok.eos_token_id,
                )
            new = out[0, ids.shape[1] :].tolist()
            eos = self.tok.eos_token_id
            stop = eos in new
            new = new[: new.index(eos)] if stop else new
            return new, int(stop), ids.shape[1]

    args = _vllm_args(release_copy, max_tokens_limit=64)
    application = PremiumLLMServer.options(
        ray_actor_options={
            "num_cpus": 0,
            "runtime_env": {"env_vars": {"PRIVCODE_TEST_SERVE_KEY": TEST_KEY}},
        }
    ).bind(args, StandInVLLM.bind(str(merged)), str(merged))
    try:
        serve.run(application, name="premium-vllm-test", route_prefix="/premium-vllm")
        url = f"{serve_http}/premium-vllm"
        body = {"prompt": PROMPT, "max_tokens": 12}
        assert http_json(f"{url}/v1/completions", body)[0] == 401
        status, answer = http_json(f"{url}/v1/completions", body, key=TEST_KEY)
        assert status == 200, answer
        choice = answer["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (
            expected.text,
            expected.finish_reason,
        )
        assert answer["usage"]["completion_tokens"] == expected.completion_tokens
        assert answer["model"] == "privcode-premium"
        status, err = http_json(
            f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 65}, key=TEST_KEY
        )
        assert status == 400 and err["error"]["param"] == "max_tokens"
        status, err = http_json(
            f"{url}/v1/completions", {"prompt": PROMPT, "temperature": 1e-300}, key=TEST_KEY
        )
        assert status == 400 and err["error"]["param"] == "temperature"
        status, err = http_json(
            f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 13}, key=TEST_KEY
        )
        assert status == 500 and "boom" not in json.dumps(err)
        status, models = http_json(f"{url}/v1/models", key=TEST_KEY)
        assert status == 200 and models["data"][0]["id"] == "privcode-premium"
        status, schema = http_json(f"{url}/openapi.json", key=TEST_KEY)
        assert status == 200 and "/v1/completions" in schema["paths"]
        # chat, n and streaming through the engine, with the official client
        import openai

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TEST_KEY, max_retries=0)
        msgs = [{"role": "user", "content": PROMPT}]
        chat = client.chat.completions.create(
            model="privcode-premium", messages=msgs, max_tokens=12, n=2
        )
        assert [c.message.content for c in chat.choices] == [expected_chat.text] * 2
        chunks = client.chat.completions.create(
            model="privcode-premium", messages=msgs, max_tokens=12, stream=True
        )
        joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert joined == expected_chat.text
    finally:
        serve.delete("premium-vllm-test")


@pytest.mark.skipif(HAS_VLLM, reason="checks the refusal without vLLM")
def test_privcode_serve_engine_vllm_without_vllm_stops_before_ray(
    release_copy, monkeypatch, tmp_path, capsys
):
    from privcode.cli import main

    monkeypatch.setenv("PRIVCODE_API_KEY", TEST_KEY)
    monkeypatch.setattr(
        "privcode.cluster.local.connect", lambda *a, **k: pytest.fail("connected to Ray")
    )
    args = ["serve", "--premium", str(release_copy), "--set", f"run.out_dir={tmp_path}"]
    assert main([*args, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'privcode[vllm]'" in err and "transformers" in err
    assert not (release_copy / MERGED_DIR).exists()  # refused before writing anything
