"""The parts of the GPU check (``bench/gpu_check.py`` runs each in its own subprocess).

Each ``part_*`` function takes a :class:`Part` (device, dtypes, soft deadline,
the table it prints and the rows it writes) and measures, at real shapes with
random weights and random token ids:

* ``dp``: DP vs non-DP step time and peak memory
  (``torch.cuda.max_memory_allocated``, weights and optimizer state
  included), LoRA (r=8, frozen bf16 base, fp32 adapters) and full fine-tune
  (fp32 weights) of the 1.5B shape, forward under bf16 autocast. DP step:
  :meth:`privcode.dp.dpsgd.PerSampleClipper.clipped_sum` +
  :func:`privcode.dp.dpsgd.privatize` + AdamW, as in ``bench/dp_overhead.py``;
  non-DP: mean loss, backward, AdamW. Median of ``--steps`` after a warm-up.
* ``generate``: release generation tokens/s (``generate`` with the release's
  sampling, :func:`privcode.models.sampling.sampling_kwargs`, on the merged
  1.5B shape in bf16), batch 1 vs ``--gen-batch``.
* ``pac``: :meth:`privcode.pac.ensemble.PacEnsemble.step_logprobs` latency
  per token for m = 8, 32, 128 LoRA worlds vs one world alone.
* ``zero3``: premium steps under DeepSpeed ZeRO-3 on one GPU
  (:func:`privcode.premium.train.deepspeed_config` of ``zero3.json``, the
  premium loss, LoRA r=16); falls back to torch's AdamW, saying so, when
  DeepSpeed's fused Adam cannot be built (no CUDA toolkit).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import time
from pathlib import Path

JUNIOR, PREMIUM = "qwen2.5-coder-1.5b", "qwen2.5-coder-7b"
GIB = float(1 << 30)


class Part:
    """One part in its child process: device, dtypes, soft deadline, table, rows (a JSON file)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args, self.torch = args, torch
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.rows: list[dict] = []
        self.last = 0.0  # seconds the previous configuration took
        self.widths: list[int] = []
        #: The DP forward's autocast dtype (bf16 on CPU too: the smoke run takes the GPU's path).
        self.amp = torch.bfloat16 if (not self.cuda or torch.cuda.is_bf16_supported()) else None
        #: Inference weights (generation, PAC): bf16 on the GPU, fp32 on CPU (as PacEnsemble
        #: and the release load them there).
        self.dtype = torch.bfloat16 if self.cuda and self.amp is not None else torch.float32

    def shape(self, real: str) -> str:
        return "tiny" if self.args.tiny else real

    def header(self, title: str, *columns: tuple[str, int]) -> None:
        print(title, flush=True)
        self.widths = [w for _, w in columns]
        self.line(*(name for name, _ in columns))

    def line(self, *values: object) -> None:
        print(
            "  " + " ".join(f"{v!s:>{w}}" for v, w in zip(values, self.widths, strict=True)),
            flush=True,
        )

    def add(self, config: str, result: str, vs: str = "-", **data: object) -> None:
        self.rows.append({"part": self.args.part, "config": config, "result": result, "vs": vs})
        self.rows[-1].update(data)
        Path(self.args.result).write_text(json.dumps(self.rows))

    def guarded(self, config: str, fn):
        """``fn()``, or None: skipped (its time would overrun the soft deadline) or out of memory."""
        if time.time() + self.last >= self.args.deadline:
            print(f"  {config}: skipped, the part's time budget is spent", flush=True)
            self.add(config, "skipped: time budget")
            return None
        self.free()
        started = time.time()
        try:
            return fn()
        except self.torch.OutOfMemoryError:
            self.free()
            print(f"  {config}: out of memory", flush=True)
            self.add(config, "out of memory")
            return None
        finally:
            self.last = time.time() - started

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, step, n: int) -> tuple[float, float]:
        """(the first call's seconds, the median of the ``n`` calls after it), synchronised."""
        times = []
        for _ in range(n + 1):
            t0 = time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - t0)
        return times[0], statistics.median(times[1:])

    def gib(self, peak: bool = True) -> str:
        if not self.cuda:
            return "-"
        c = self.torch.cuda
        return f"{(c.max_memory_allocated() if peak else c.memory_allocated()) / GIB:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _batch(part: Part, vocab: int, rows: int) -> dict:
    """Random token ids, every token a code token (the DP objective's and premium loss' input)."""
    import torch

    from privcode.models.encoding import CODE, PAD

    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(2, vocab, (rows, part.args.length), generator=gen).to(part.device)
    segments = torch.full_like(ids, CODE)
    mask = (segments != PAD).long()
    return {"input_ids": ids, "attention_mask": mask, "segments": segments, "structural": 0 * ids}


# --------------------------------------------------------------------------- dp


def _dp_run(part: Part, tune: str, mode: str, rows: int) -> tuple[float, float, str, str]:
    """(first s, median step s, model GiB, peak GiB) of one fine-tune x mode."""
    import torch

    from privcode.config import TrainConfig
    from privcode.dp.dpsgd import PerSampleClipper, apply_flat_gradient, privatize
    from privcode.dp.randomness import SecretRandomness
    from privcode.models.loading import attach_lora
    from privcode.models.shapes import random_causal_lm
    from privcode.train.methods import MethodContext, Objective, get_method

    lora = tune == "lora"
    # LoRA: the frozen base in the autocast dtype; full fine-tune: fp32 master weights.
    dtype = (part.amp or torch.float32) if lora else torch.float32
    lm = random_causal_lm(part.shape(JUNIOR), dtype=dtype, device=part.device)
    if lora:
        lm = attach_lora(lm, r=8, alpha=16)  # peft keeps the adapter weights fp32
    ctx = MethodContext(cfg=TrainConfig(), eos_id=0, pad_id=0)
    objective = Objective(get_method("dpft"), lm.train(), ctx).to(part.device)
    params = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    batch = _batch(part, lm.config.vocab_size, rows)

    def loss_fn(module, b):
        with torch.autocast(part.device.type, dtype=part.amp, enabled=part.amp is not None):
            return module(b)

    clipper = randomness = None
    if mode == "dp":
        clipper = PerSampleClipper(objective, mode=part.args.grad_sample_mode, max_grad_norm=1.0)
        randomness = SecretRandomness(seed=int.from_bytes(os.urandom(15), "little"))

    def step() -> None:
        if clipper is None:
            loss_fn(objective, batch).mean().backward()
        else:
            s = clipper.clipped_sum(loss_fn, batch, rows)
            g = privatize(
                s,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=float(rows),
                add_noise=True,
                generator=randomness.noise_generator(part.device),
                all_reduce=None,
            )
            apply_flat_gradient(params, g)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    part.sync()
    model_gib = part.gib(peak=False)
    first, median = part.timed(step, part.args.steps)  # first: Opacus hooks, AdamW state
    return first, median, model_gib, part.gib()


def part_dp(part: Part) -> None:
    a = part.args
    part.header(
        f"dp: {part.shape(JUNIOR)} shape, sequence {a.length}, forward autocast {part.amp}, "
        f"grad-sample mode {a.grad_sample_mode}; median of {a.steps} steps after 1 warm-up",
        *[("fine-tune", 10), ("mode", 6), ("batch", 7), ("first s", 8), ("step s", 8)],
        *[("model GiB", 10), ("peak GiB", 9), ("x nondp step", 13), ("x nondp peak", 13)],
    )
    for tune, rows in (("lora", a.batch), ("full", a.full_batch)):
        ref = None
        for mode in ("nondp", "dp"):
            config = f"{'LoRA r=8' if tune == 'lora' else 'full'} {mode} {rows}x{a.length}"
            got = part.guarded(config, lambda t=tune, m=mode, r=rows: _dp_run(part, t, m, r))
            if got is None:
                continue
            first, step, model_gib, peak = got
            ref = got if mode == "nondp" else ref
            vs_t = _ratio(step, ref[1]) if ref and mode == "dp" else "-"
            vs_m = "-"
            if ref and mode == "dp" and part.cuda:
                vs_m = _ratio(float(peak), float(ref[3]))
            part.line(
                tune,
                mode,
                f"{rows}x{a.length}",
                f"{first:.3f}",
                f"{step:.3f}",
                model_gib,
                peak,
                vs_t,
                vs_m,
            )
            vs = f"{vs_t} time, {vs_m} peak" if mode == "dp" else "-"
            part.add(config, f"{step:.3f} s/step, peak {peak} GiB", vs, step_s=step)


# --------------------------------------------------------------------------- generate


def part_generate(part: Part) -> None:
    import torch
    from transformers import GenerationConfig

    from privcode.models.sampling import sampling_kwargs
    from privcode.models.shapes import random_causal_lm

    a = part.args
    model = random_causal_lm(part.shape(JUNIOR), dtype=part.dtype, device=part.device)
    eos = model.config.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    part.header(
        f"generate: {part.shape(JUNIOR)} shape in {part.dtype}, prompt {a.prompt_tokens} "
        f"tokens, {a.new_tokens} new tokens per row (temperature 0.8, top-p 0.95)",
        *[("batch", 6), ("seconds", 8), ("tokens/s", 10), ("x batch 1", 10)],
    )

    def run(rows: int, new: int) -> float:
        gen = torch.Generator().manual_seed(rows)
        shape = (rows, a.prompt_tokens)
        ids = torch.randint(2, model.config.vocab_size, shape, generator=gen).to(part.device)
        part.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                **sampling_kwargs(0.8, 0.95),
            )
        part.sync()
        assert out.shape == (rows, a.prompt_tokens + new), tuple(out.shape)
        return time.perf_counter() - t0

    run(1, 2)  # warm-up
    single = None
    for rows in dict.fromkeys((1, a.gen_batch)):
        config = f"batch {rows} x {a.new_tokens} new tokens"
        seconds = part.guarded(config, lambda r=rows: run(r, a.new_tokens))
        if seconds is None:
            continue
        rate = rows * a.new_tokens / seconds
        single = rate if rows == 1 else single
        vs = _ratio(rate, single) if rows != 1 else "-"
        part.line(rows, f"{seconds:.2f}", f"{rate:.1f}", vs)
        part.add(config, f"{rate:.1f} tokens/s", f"{vs} vs batch 1" if rows != 1 else "-")


# --------------------------------------------------------------------------- pac


def _ensemble(model, worlds: list[str], device, *, public: bool = True):
    """A :class:`PacEnsemble` over an in-memory peft model that holds (at least) ``worlds``.

    ``PacEnsemble.__init__`` loads a worlds artifact from disk; this sets the
    attributes its :meth:`step_logprobs` reads from a model already built.
    ``public=False``: one row through ``worlds[0]`` alone (``m`` 0: the
    "public" row is that world's), the one-world baseline.
    """
    import inspect
    import threading

    from privcode.artifacts.pac import BASE_ROW
    from privcode.pac.ensemble import PacEnsemble

    class InMemoryEnsemble(PacEnsemble):
        def __init__(self) -> None:
            keep = inspect.signature(type(model.get_base_model()).forward).parameters
            self.model, self.device, self.top_k = model, device, 50
            self.worlds = tuple(worlds) if public else ()
            self.m = len(self.worlds)
            self._rows = [*worlds, BASE_ROW] if public else [worlds[0]]
            self._forward_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in keep else {}
            self._cache_arg = "cache" if "cache" in keep else "past_key_values"
            self._lock = threading.Lock()
            self._stacked = self._stack()  # the stacked multi-LoRA forward, as loaded ones

    return InMemoryEnsemble()


def _add_worlds(model, cfg, names: list[str], device):
    """Add the LoRA worlds ``names[1:]`` to peft ``model`` (which holds ``names[0]``), on ``device``.

    Each LoRA layer gets every world through peft's own ``update_layer`` (what
    ``add_adapter`` and ``load_adapter`` run per layer), built on ``device``.
    peft re-activates all of a layer's adapters after each add (O(m) per add,
    O(m^2) per layer: minutes at m = 128 over 196 layers); here that runs once
    per layer, after its last add. Adapter weights end fp32 as loaded worlds'
    are (peft's ``autocast_adapter_dtype``), B drawn N(0, 0.02^2) (peft
    starts it at 0); nothing requires grad.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    layers = [(key, m) for key, m in model.named_modules() if isinstance(m, LoraLayer)]
    with torch.device(device):
        for key, layer in layers:
            layer.set_adapter = lambda *a, **k: None  # an instance attribute, deleted below
            try:
                for name in names[1:]:
                    layer.update_layer(
                        name, cfg.r, lora_alpha=cfg.lora_alpha, target_name=key, config=cfg
                    )
            finally:
                del layer.set_adapter
            layer.set_adapter(layer.active_adapters)
    model.peft_config.update(dict.fromkeys(names[1:], cfg))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
                if "lora_B" in n:
                    p.normal_(0.0, 0.02, generator=gen)
            p.requires_grad_(False)
    return model.eval()  # peft mixes adapters in eval mode only


def part_pac(part: Part) -> None:
    import torch
    from peft import get_peft_model

    from privcode.models.loading import lora_config
    from privcode.models.shapes import random_causal_lm
    from privcode.pac.worlds import world_names

    a = part.args
    started = time.perf_counter()
    base = random_causal_lm(part.shape(JUNIOR), dtype=part.dtype, device=part.device)
    cfg = lora_config(base, r=8, alpha=16)
    names = world_names(max(a.worlds))
    model = _add_worlds(get_peft_model(base, cfg, adapter_name=names[0]), cfg, names, part.device)
    part.sync()
    prompt = torch.randint(2, base.config.vocab_size, (a.prompt_tokens,)).tolist()
    part.header(
        f"pac: {part.shape(JUNIOR)} base in {part.dtype} + {len(names)} LoRA worlds (r=8), built "
        f"in {time.perf_counter() - started:.1f} s; prompt {a.prompt_tokens} tokens; median of "
        f"{a.pac_tokens} tokens after 2",
        *[("worlds", 9), ("rows", 5), ("prefill ms", 11), ("ms/token", 9), ("x one world", 12)],
        ("ms/row", 7),
    )

    def decode(ens) -> tuple[float, float]:
        t0 = time.perf_counter()
        lp, past = ens.step_logprobs(prompt, None)
        prefill, times = time.perf_counter() - t0, []
        for _ in range(2 + a.pac_tokens):
            t0 = time.perf_counter()
            lp, past = ens.step_logprobs([int(lp.candidates[0])], past)
            times.append(time.perf_counter() - t0)
        return prefill * 1e3, statistics.median(times[2:]) * 1e3

    one = None
    for m in (1, *a.worlds):
        config = "one world (1 row)" if m == 1 else f"m={m} worlds ({m + 1} rows)"
        ens = _ensemble(model, names[:m], part.device, public=m > 1)
        got = part.guarded(config, lambda ens=ens: decode(ens))
        if got is None:
            continue
        prefill, ms = got
        one = ms if m == 1 else one
        vs = _ratio(ms, one) if m > 1 else "-"
        rows = m + 1 if m > 1 else 1
        label = "1 (alone)" if m == 1 else m
        part.line(label, rows, f"{prefill:.1f}", f"{ms:.2f}", vs, f"{ms / rows:.2f}")
        part.add(config, f"{ms:.2f} ms/token", f"{vs} vs one world" if m > 1 else "-")


# --------------------------------------------------------------------------- zero3


def _cpu_ops_missing() -> list[str]:
    """DeepSpeed CPU ops that ZeRO-3 here would JIT-compile first (not in the build cache)."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    missing = []
    for kind in ("ShareMemCommBuilder", "FusedAdamBuilder"):
        builder = get_accelerator().create_op_builder(kind)
        if builder is not None:
            so = Path(_get_build_directory(builder.name, verbose=False)) / f"{builder.name}.so"
            missing += [] if so.is_file() else [builder.name]
    return missing


def part_zero3(part: Part) -> None:
    import torch

    from privcode.config import PremiumConfig
    from privcode.models.loading import attach_lora
    from privcode.models.shapes import layers_that_fit, param_count, random_causal_lm
    from privcode.premium.train import _code_loss, deepspeed_config

    a, shape, config = part.args, part.shape(PREMIUM), "ZeRO-3 premium step"
    try:
        import deepspeed
    except ImportError as exc:
        print(f"zero3: skipped, DeepSpeed is not installed ({exc}; pip install '.[train]')")
        return part.add(config, "skipped: DeepSpeed not installed")
    if not part.cuda and not a.zero3_build and (missing := _cpu_ops_missing()):
        why = (
            f"DeepSpeed would JIT-compile its CPU ops {', '.join(missing)} first (minutes, once "
            "per machine, cached in ~/.cache/torch_extensions); --zero3-build allows it"
        )
        print(f"zero3: skipped on CPU: {why}", flush=True)
        return part.add(config, f"skipped on CPU: {why}")
    layers = a.zero3_layers
    if layers is None and part.cuda:
        free = torch.cuda.mem_get_info()[0]
        layers = layers_that_fit(shape, 0.5 * free, bytes_per_param=2)
        if layers == 0:
            print(f"zero3: skipped, no layer of {shape} fits in half of {free / GIB:.1f} GiB")
            return part.add(config, "skipped: no layer fits")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0"}
    os.environ.update(env, WORLD_SIZE="1")
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if part.cuda else "gloo")
    cfg = PremiumConfig(deepspeed="zero3", batch_size=a.batch)
    ds = deepspeed_config(cfg, use_bf16=part.cuda)
    label = (
        f"{shape} shape, {layers or 'all'} layers ({_count(param_count(shape, layers))} "
        f"params), LoRA r={cfg.lora_r}, {a.batch}x{a.length}"
    )
    print(f"zero3: {label}, bf16 {part.cuda}", flush=True)

    def build(client_optimizer: bool):
        dtype = part.dtype if part.cuda else torch.float32
        lm = random_causal_lm(shape, num_layers=layers, dtype=dtype, device=part.device)
        model = attach_lora(lm, r=cfg.lora_r, alpha=cfg.lora_alpha)
        params = [p for p in model.parameters() if p.requires_grad]
        if not client_optimizer:
            return deepspeed.initialize(model=model, model_parameters=params, config=ds)[0]
        plain = {k: v for k, v in ds.items() if k != "optimizer"}
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        plain["zero_allow_untested_optimizer"] = True
        return deepspeed.initialize(model=model, optimizer=opt, config=plain)[0]

    note = ""
    try:
        engine = build(client_optimizer=False)
    except Exception as exc:  # noqa: BLE001 - e.g. FusedAdam's JIT build without a CUDA toolkit
        note = f"DeepSpeed's Adam failed ({type(exc).__name__}: {str(exc)[:200]}); torch AdamW"
        print(f"  {note}", flush=True)
        part.free()
        engine = build(client_optimizer=True)
    part.sync()
    init = time.perf_counter() - t0
    batch = _batch(part, engine.module.config.vocab_size, a.batch)

    def step() -> None:
        engine.backward(_code_loss(engine, batch))
        engine.step()

    first, median = part.timed(step, a.steps)
    print(
        f"  init {init:.1f} s (process group, model, deepspeed.initialize); first step "
        f"{first:.3f} s; step {median:.3f} s (median of {a.steps}); peak {part.gib()} GiB",
        flush=True,
    )
    result = f"{median:.3f} s/step, peak {part.gib()} GiB, init {init:.1f} s"
    part.add(f"ZeRO-3 {label}", result + (f"; {note}" if note else ""))
    torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- by name

#: The part functions by ``--part`` name (the names of ``gpu_check.PARTS``).
RUNS = {"dp": part_dp, "generate": part_generate, "pac": part_pac, "zero3": part_zero3}
