"""Golden outputs: every generation path reproduces, token for token, what it produced before
``privcode.models.generate`` replaced its own ``model.generate`` call (issue 44).

The six paths run through their public entry points on the ci model (eval's
``generate_completions``, serve's ``PremiumModel.generate_batch``, the probe's
``HFBackend.complete``, the canary sampler ``sample_continuations``, the junior release's
``generate``, synth's ``HFGenerator.generate``), greedy and seeded-sampled, and must give
exactly the texts (and serve's token counts) in ``tests/golden/generate.json``, captured on
the code before the change (``tests/golden/capture_generate.py``). The file records the
sha256 of the ci model's weights it was captured with: other weights (another CPU can train
a different ci model) cannot be compared, and the test says so and skips.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import privacy_record

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOLDEN = Path(__file__).parent / "golden" / "generate.json"
CAPTURE = os.environ.get("PRIVCODE_GOLDEN_CAPTURE") == "1"

PROMPTS = [
    "def add(a, b):\n",
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n",
    "# parse the header\ndef parse_header(line):\n",
]
CONTEXTS = ['db_password = "', "Send failure reports to ", ""]


def _first(name: str, *modules: str) -> Any:
    """``name`` from the first of ``modules`` that has it (the release code is being moved)."""
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{name} is in none of {', '.join(modules)}")


def load_release(path: Path) -> Any:
    return _first("load_release", "privcode.models.junior", "privcode.release")(path)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def golden(ci_model: str) -> dict[str, Any]:
    sha = _sha256(Path(ci_model) / "model.safetensors")
    if CAPTURE:
        data = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        if data.get("ci_model_sha256") != sha:
            data = {"ci_model_sha256": sha, "cases": {}}
        yield data
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        return
    data = json.loads(GOLDEN.read_text(encoding="utf-8"))
    if data["ci_model_sha256"] != sha:
        pytest.skip(
            f"this machine's ci model (weights sha256 {sha[:12]}) is not the one "
            f"{GOLDEN.name} was captured with ({data['ci_model_sha256'][:12]}): no golden"
        )
    yield data


def check(golden: dict[str, Any], case: str, got: Any) -> None:
    """``got`` (JSON round-tripped) equals the captured case; in capture mode, record it."""
    got = json.loads(json.dumps(got))
    if CAPTURE:
        golden["cases"][case] = got
        return
    assert got == golden["cases"][case], f"{case}: not the captured output"


@pytest.fixture(scope="module")
def releases(ci_model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A latent and a prompt junior release of the ci base: seeded LoRA (B != 0), a decoder."""
    from privcode.models.loading import attach_lora, load_causal_lm

    write_release = _first(
        "write_release",
        "privcode.release",
        "privcode.train.release",
        "privcode.train.artifact",
        "privcode.artifacts.junior",
    )
    root = tmp_path_factory.mktemp("golden-release")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = attach_lora(load_causal_lm(ci_model), r=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(root / "adapter"))
    hidden = model.config.hidden_size
    decoder = {"weight": torch.randn(2 * hidden, 8, generator=gen), "bias": torch.zeros(2 * hidden)}
    common = {"adapter_dir": root / "adapter", "privacy": privacy_record(epsilon=8.0)}
    latent = write_release(
        root / "latent",
        prefix_decoder=decoder,
        meta={
            "method": "privcode++",
            "conditioning": "latent",
            "dp": True,
            "base_model": ci_model,
            "prefix": {"dz": 8, "num_virtual_tokens": 2, "hidden_size": hidden},
            "alignment": "infonce",
        },
        **common,
    )
    prompt = write_release(
        root / "prompt",
        meta={"method": "privcode", "conditioning": "prompt", "dp": True, "base_model": ci_model},
        **common,
    )
    return {"latent": Path(latent), "prompt": Path(prompt)}


# --------------------------------------------------------------------------- eval


def test_eval_completions(golden, ci_model):
    from privcode.eval.benchmarks import Problem
    from privcode.eval.completions import generate_completions, load_generator

    gen = load_generator(ci_model)
    problems = [Problem(f"t/{i}", p, "", None, "humaneval") for i, p in enumerate(PROMPTS)]
    common = {"max_new_tokens": 24, "stop": ["\ndef ", "\n#", "return"], "progress": False}
    greedy = generate_completions(gen, problems, batch_size=2, **common)
    check(golden, "eval_greedy", [s.completion for s in greedy])
    sampled = generate_completions(
        gen, problems, n=2, temperature=0.8, top_p=0.95, seed=3, batch_size=4, **common
    )
    check(golden, "eval_sampled", [s.completion for s in sampled])
    hot = generate_completions(gen, problems, n=2, temperature=1.3, top_p=0.5, seed=9, **common)
    check(golden, "eval_sampled_top_p_0.5", [s.completion for s in hot])


# --------------------------------------------------------------------------- serve


def _serve(premium: Any, requests: list[dict[str, Any]]) -> list[list[Any]]:
    from privcode.serve.api import parse_completion

    items = [premium.prepare(parse_completion({"prompt": PROMPTS[0], **r}, 64)) for r in requests]
    out = premium.generate_batch(items)
    return [[c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens] for c in out]


def test_serve_generate_batch(golden, premium_release):
    from privcode.serve.premium import PremiumModel

    premium = PremiumModel(premium_release, device="cpu", max_tokens_limit=64)
    greedy = [
        {"prompt": PROMPTS[0], "max_tokens": 12},
        {"prompt": PROMPTS[1], "max_tokens": 20, "stop": ["e", "\n\n"]},
        {"prompt": PROMPTS[2], "max_tokens": 7},
    ]
    check(golden, "serve_greedy", _serve(premium, greedy))
    mixed = [
        {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.9, "top_p": 0.9, "seed": 5},
        {"prompt": PROMPTS[1], "max_tokens": 10, "stop": ["a"]},
        {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 1.0, "seed": 6, "stop": ["s"]},
        {"prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0.7, "seed": 7},
    ]
    check(golden, "serve_sampled", _serve(premium, mixed))


# --------------------------------------------------------------------------- probe


def test_probe_hf_backend(golden, ci_model, premium_release):
    from privcode.audit.probe import HFBackend

    backend = HFBackend(ci_model, batch_size=2)
    greedy = backend.complete(PROMPTS, max_tokens=16, temperature=0, n=2)
    check(golden, "probe_greedy", greedy)
    check(
        golden,
        "probe_sampled",
        backend.complete(PROMPTS, max_tokens=16, temperature=0.8, n=2, seed=4),
    )
    premium = HFBackend(str(premium_release), batch_size=4)
    check(golden, "probe_premium_sampled", premium.complete(PROMPTS, max_tokens=12, seed=2))


# --------------------------------------------------------------------------- canaries


def test_canary_sampler(golden, ci_model, releases):
    from privcode.audit.canaries import sample_continuations
    from privcode.audit.scoring import load_scored_model

    plain = load_scored_model(ci_model)
    kwargs = {"max_new_tokens": 12, "seed": 1, "batch_size": 2}
    check(golden, "canary_plain", sample_continuations(plain, CONTEXTS, 3, **kwargs))
    nucleus = sample_continuations(plain, CONTEXTS, 3, temperature=0.7, top_p=0.9, **kwargs)
    check(golden, "canary_plain_top_p_0.9", nucleus)
    latent = load_scored_model(releases["latent"])
    check(golden, "canary_latent", sample_continuations(latent, CONTEXTS, 3, **kwargs))


# --------------------------------------------------------------------------- junior


def test_junior_release_generate(golden, releases):
    latent, prompt = load_release(releases["latent"]), load_release(releases["prompt"])
    common = {"max_new_tokens": 12}
    check(golden, "junior_latent_greedy", latent.generate(n=3, temperature=0, seed=2, **common))
    sampled = latent.generate(n=3, temperature=0.8, top_p=0.95, seed=7, start="def ", **common)
    check(golden, "junior_latent_sampled", sampled)
    prompts = [*PROMPTS, ""]
    check(golden, "junior_prompt_greedy", prompt.generate(prompts=prompts, temperature=0, **common))
    check(golden, "junior_prompt_sampled", prompt.generate(prompts=prompts, seed=11, **common))


# --------------------------------------------------------------------------- synth


def test_synth_hf_generator(golden, ci_model):
    from privcode.synth.extract import HFGenerator

    check(
        golden,
        "synth_greedy",
        HFGenerator(ci_model, max_new_tokens=16, batch_size=2).generate(PROMPTS),
    )
    short = HFGenerator(ci_model, max_new_tokens=10, max_input_tokens=12)  # left-truncated prompts
    check(golden, "synth_greedy_truncated", short.generate(PROMPTS))
