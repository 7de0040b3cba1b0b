"""Stage II's LLM filters off the actor: an OpenAI-compatible endpoint and vLLM processors.

The endpoint client runs against a real HTTP server on 127.0.0.1 (stdlib, answering the
OpenAI completions contract): batching by concurrency, auth, retries, bounded answers, and
errors that echo nothing. The vLLM processor configs (Ray Data LLM) are built and checked
without a GPU or vLLM; tests/test_serve.py runs the endpoint client against the project's
own premium app.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from privcode.config import SynthConfig
from privcode.errors import ConfigError
from privcode.models.endpoint import EndpointError, check_endpoint_url
from privcode.synth.llm_endpoint import EndpointGenerator

SECRET_CODE = "def leak_7f3a():\n    return 'SECRET-SAMPLE-7f3a'\n"


class Completions(BaseHTTPRequestHandler):
    """POST /v1/completions: the answer is "A:" + the prompt's last line, upper-cased.

    ``server.script`` (a list) sets the status of the next requests (then 200s);
    ``server.bodies`` keeps what arrived, ``server.peak`` the most requests in flight."""

    def log_message(self, *args):  # quiet
        pass

    def do_POST(self):  # noqa: N802 - the stdlib's name
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.bodies.append((self.headers.get("Authorization"), body))
            srv.inflight += 1
            srv.peak = max(srv.peak, srv.inflight)
            status = srv.script.pop(0) if srv.script else 200
        time.sleep(srv.delay)
        with srv.lock:  # done before answering: the client's next request cannot overlap it
            srv.inflight -= 1
        if status != 200:
            self.send_response(status)
            self.end_headers()
            return
        prompt = body["prompt"]
        text = srv.answer(prompt) if srv.answer else "A:" + prompt.splitlines()[-1].upper()
        raw = text.encode() if isinstance(text, bytes | str) and srv.raw else None
        payload = raw or json.dumps({"choices": [{"index": 0, "text": text}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    srv.lock, srv.bodies, srv.script = threading.Lock(), [], []
    srv.inflight = srv.peak = 0
    srv.delay, srv.answer, srv.raw = 0.05, None, False
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def test_endpoint_urls():
    assert check_endpoint_url("https://llm.internal:8000/v1/") == "https://llm.internal:8000"
    assert check_endpoint_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert check_endpoint_url("http://localhost:9000/v1") == "http://localhost:9000"
    for bad in ("ftp://x", "llm:8000", "http://10.0.0.7:8000", "http://llm.internal"):
        with pytest.raises(EndpointError, match="synth.llm_endpoint"):
            check_endpoint_url(bad, "synth.llm_endpoint")


def test_generate_batches_by_concurrency_in_order_with_the_token(server, monkeypatch):
    monkeypatch.setenv("PRIVCODE_TEST_LLM_KEY", "tok-123")
    gen = EndpointGenerator(
        server.url,
        model="m1",
        api_key_env="PRIVCODE_TEST_LLM_KEY",
        concurrency=4,
        max_new_tokens=7,
    )
    prompts = [f"task\nline {i}" for i in range(12)]
    assert gen.generate(prompts) == [f"A:LINE {i}" for i in range(12)]
    assert server.peak == 4  # four in flight: the server batches them
    auth = {a for a, _ in server.bodies}
    assert auth == {"Bearer tok-123"}
    body = server.bodies[0][1]
    assert body["model"] == "m1" and body["max_tokens"] == 7 and body["temperature"] == 0.0
    assert gen.generate([]) == []


def test_retries_transient_errors_then_fails_naming_only_the_url(server):
    server.script = [503, 429]
    gen = EndpointGenerator(server.url, api_key_env="", retries=2, backoff=0.01)
    assert gen.generate(["x\ny"]) == ["A:Y"]
    assert [a for a, _ in server.bodies] == [None] * 3  # no token variable: no header
    server.script = [503] * 3
    with pytest.raises(EndpointError, match=r"failed 3 times \(last: HTTP 503\)") as err:
        gen.generate([SECRET_CODE])
    assert "SECRET" not in str(err.value)
    server.script, sent = [401], len(server.bodies)
    with pytest.raises(EndpointError, match="HTTP 401: Unauthorized"):
        gen.generate(["x"])
    assert len(server.bodies) == sent + 1  # not retried


def test_hostile_answers_are_bounded_and_never_echoed(server):
    gen = EndpointGenerator(server.url, api_key_env="", max_response_chars=50, retries=0)
    server.answer = lambda p: "B" * 10_000  # over the cap in the JSON: refused
    with pytest.raises(EndpointError, match="answer larger than") as err:
        gen.generate([SECRET_CODE])
    assert "SECRET" not in str(err.value) and "BBBB" not in str(err.value)
    server.answer = lambda p: "C" * 120  # within the byte cap: cut to max_response_chars
    assert gen.generate(["x"]) == ["C" * 50]
    server.answer, server.raw = (lambda p: "<html>SECRET-SAMPLE-7f3a</html>"), True
    with pytest.raises(EndpointError, match="not an OpenAI completions answer") as err:
        gen.generate(["x"])
    assert "SECRET" not in str(err.value)


def test_endpoint_extractor_and_summariser_through_the_registries(server):
    from privcode.synth.extract import EndpointExtractor, make_extractor
    from privcode.synth.roundtrip import RoundTripFilter

    server.answer = lambda p: "Instruction: Write add()." if "instruction" in p else "Adds."
    ext = make_extractor("endpoint", url=server.url, api_key_env="", concurrency=2)
    assert isinstance(ext, EndpointExtractor)
    assert ext.extract(["def add(a, b):\n    return a + b\n"]) == ["Write add()."]
    server.answer = lambda p: "   "  # nothing: the offline instruction instead
    assert ext.extract(["def add(a, b):\n    return a + b\n"])[0].startswith("Write")
    server.answer = lambda p: "Adds two numbers."
    rt = RoundTripFilter(
        summarizer="endpoint", summarizer_url=server.url, summarizer_api_key_env=""
    )
    assert rt.summaries(["def add(a, b):\n    return a + b\n"]) == ["Adds two numbers."]


def test_config_needs_the_endpoint_and_the_vllm_model():
    from privcode.config import load_config

    with pytest.raises(ConfigError, match="llm_endpoint"):
        load_config(None, ["synth.extractor=endpoint"])
    with pytest.raises(ConfigError, match="summarizer_model"):
        load_config(None, ["synth.summarizer=vllm"])
    cfg = load_config(
        None, ["synth.summarizer=endpoint", "synth.llm_endpoint=https://llm.internal"]
    )
    assert cfg.synth.summarizer == "endpoint"


def test_llm_options_per_kind():
    from privcode.synth.dataflow import llm_options

    cfg = SynthConfig(
        extractor="endpoint",
        extractor_model="coder-8b",
        llm_endpoint="https://llm.internal/v1",
        llm_concurrency=32,
        llm_max_new_tokens=64,
        summarizer="hf",
        summarizer_model="/models/m",
    )
    assert llm_options(cfg, "extractor") == {
        "url": "https://llm.internal/v1",
        "model": "coder-8b",
        "api_key_env": "PRIVCODE_LLM_API_KEY",
        "concurrency": 32,
        "max_new_tokens": 64,
    }
    assert llm_options(cfg, "summarizer") == {"model": "/models/m", "max_new_tokens": 64}
    assert llm_options(SynthConfig(), "extractor") == {}
    with pytest.raises(EndpointError, match="plain http"):
        llm_options(SynthConfig(extractor="endpoint", llm_endpoint="http://10.1.2.3"), "extractor")


def test_vllm_processor_configs_build_without_a_gpu():
    pytest.importorskip("ray.data.llm")
    from privcode.synth.llm_stages import vllm_processor_config

    cfg = SynthConfig(
        extractor="vllm",
        extractor_model="/mnt/models/Llama-3.1-8B-Instruct",
        summarizer="vllm",
        summarizer_model="/mnt/models/Qwen2.5-7B-Instruct",
        dtype="bfloat16",
        vllm_engines=3,
        vllm_tensor_parallel_size=2,
        vllm_max_model_len=8192,
        vllm_accelerator_type="H100",
        llm_concurrency=4,
        extract_batch_size=128,
    )
    ext = vllm_processor_config(cfg, "extractor")
    assert ext.model_source == "/mnt/models/Llama-3.1-8B-Instruct"
    assert ext.concurrency == 3 and ext.batch_size == 128 and ext.max_concurrent_batches == 4
    assert ext.accelerator_type == "H100"
    assert ext.engine_kwargs["tensor_parallel_size"] == 2
    assert ext.engine_kwargs["max_model_len"] == 8192 and ext.engine_kwargs["dtype"] == "bfloat16"
    summ = vllm_processor_config(cfg, "summarizer")
    assert summ.model_source == "/mnt/models/Qwen2.5-7B-Instruct" and summ.batch_size == 64
    with pytest.raises(ValueError, match="unknown LLM role"):
        vllm_processor_config(cfg, "scorer")


def test_vllm_rows_in_and_out():
    """The processors' row functions: the request of each row and what comes back."""
    from privcode.synth.llm_stages import _answer, _request

    code = "def add(a, b):\n    return a + b\n"
    req = _request("extractor", 48)({"code": code, "index": 3})
    assert req["sampling_params"] == {"temperature": 0.0, "max_tokens": 48}
    assert code in req["messages"][0]["content"]
    cols = ("index", "code", "cond_prompt")
    out = _answer("extractor", cols)(
        {"index": 3, "code": code, "cond_prompt": "", "generated_text": " Add two numbers. "}
    )
    assert out == {"index": 3, "code": code, "cond_prompt": "", "prompt": "Add two numbers."}
    kept = _answer("extractor", cols)(
        {"index": 3, "code": code, "cond_prompt": "public p", "generated_text": "x"}
    )
    assert kept["prompt"] == "public p"  # prompt-conditioned: the public prompt stays
    empty = _answer("extractor", cols)({"index": 3, "code": code, "cond_prompt": ""})
    assert empty["prompt"].startswith("Write")  # no answer: the offline instruction
    # The summariser asks one token for rows the sandbox removed and drops the answer.
    assert (
        _request("summarizer", 48)({"code": code, "exec_passed": False})["sampling_params"][
            "max_tokens"
        ]
        == 1
    )
    failed = _answer("summarizer", ("code", "exec_passed"))(
        {"code": code, "exec_passed": False, "generated_text": "z"}
    )
    assert failed["summary"] == ""


def test_roundtrip_scores_summaries_from_the_column():
    import numpy as np

    from privcode.synth.operators import RoundTripScore

    rt = RoundTripScore("vllm", "embedding", 0.5, {}, None, 1)
    batch = {
        "prompt": np.array(["Add two numbers.", "Add two numbers."], dtype=object),
        "code": np.array(["def f(): pass\n"] * 2, dtype=object),
        "summary": np.array(["Adds two numbers.", "Opens a socket to a server."], dtype=object),
        "exec_passed": np.array([True, True]),
    }
    out = rt(batch)
    assert out["roundtrip_passed"].tolist() == [True, False]


def test_the_planner_counts_the_vllm_engines():
    from privcode.config import load_config
    from privcode.pipeline.stages import SynthStage

    cfg = load_config(
        None,
        [
            "synth.extractor=vllm",
            "synth.extractor_model=/m",
            "synth.vllm_engines=2",
            "synth.vllm_tensor_parallel_size=2",
        ],
    )
    workers = {w.kind: w for w in SynthStage.workers(cfg)}
    assert "Ray Data extract filter actors" not in workers  # the processor replaces it
    engines = workers["vLLM extractor engines"]
    assert (engines.count, engines.gpus, engines.required) == (2, 2.0, 2)
    assert SynthStage.gpu_footprint(cfg) == 4.0
