"""The bench/ scripts run at their smallest setting, so a refactor cannot break one unnoticed.

Every script in bench/ runs here once, as a subprocess (as on the command
line), on the ci base model where it needs one and on the session Ray head
where it needs Ray (the subprocess inherits ``RAY_ADDRESS`` and the token
settings). The numbers they print are not asserted (timings belong to the
benchmarks, run side by side on a quiet machine); only that each script
runs to the end and prints its summary and ratio lines.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = {
    "bench_admission.py",
    "bench_base.py",
    "bench_ingest.py",
    "bench_pac.py",
    "bench_records.py",
    "bench_roundtrip.py",
    "bench_sampling.py",
    "bench_sandbox.py",
    "bench_serve.py",
    "bench_synth.py",
    "dp_overhead.py",
    "gpu_check.py",
    "train_scaling.py",
}
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def _run(script: str, *args: str, timeout: int = 600) -> str:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


def _line(out: str, pattern: str) -> re.Match:
    """The first line of ``out`` that ``pattern`` matches from its start (fails the test if none)."""
    for line in out.splitlines():
        match = re.match(pattern, line.strip())
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} in:\n{out}")


def test_every_bench_script_has_a_test():
    """A new bench script needs its smallest-setting test here (and a line in bench/README.md).

    ``_*.py`` are modules the scripts import (``_gpu_check_parts.py``), not scripts.
    """
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == SCRIPTS, "update SCRIPTS and add a test for: " + ", ".join(
        sorted(scripts ^ SCRIPTS)
    )
    tested = set(re.findall(r'_run\(\s*"([a-z_]+\.py)"', Path(__file__).read_text()))
    assert tested == SCRIPTS
    readme = (BENCH / "README.md").read_text()
    assert all(f"bench/{name}" in readme for name in SCRIPTS)


@pytest.mark.heavy  # a bench script in a subprocess
def test_bench_admission_smallest():
    out = _run("bench_admission.py", "--records", "300", "--runs", "3")
    _line(out, rf"admission total +{NUMBER} s")
    _line(out, rf"per record x run / grouped: x{NUMBER}$")


@pytest.mark.heavy  # a bench script in a subprocess
def test_bench_records_smallest():
    out = _run("bench_records.py", "--records", "20")
    assert {"jsonl", "parquet"} <= {line.split()[0] for line in out.splitlines() if line.strip()}
    _line(out, rf"parquet/jsonl: write x{NUMBER}, read x{NUMBER}, size x{NUMBER}$")


@pytest.mark.heavy  # a bench script in a subprocess (7 s)
def test_bench_sampling_smallest():
    out = _run("bench_sampling.py", "--batch", "2", "--vocab", "64", "--calls", "2")
    assert _line(out, r"rows that differ: (0\.000)$")
    _line(out, rf"NucleusFilter/TopPLogitsWarper speed: x{NUMBER}$")


def test_bench_sandbox_smallest():
    out = _run("bench_sandbox.py", "--snippets", "2", "--workers", "1")
    _line(out, r"isolation: \S+; CPUs: [0-9]+")
    _line(out, rf"run_code, sequential +: +{NUMBER} snippets/s")
    _line(out, rf"SandboxPool\(1 workers\) +: +{NUMBER} snippets/s")
    _line(out, rf"pool / sequential +: +{NUMBER}x$")
    if "isolation: namespaces+uid+seccomp" in out:  # root: the layers side by side
        for name in (r"namespaces\+uid only", r"\+ seccomp", r"\+ cgroup", r"\+ seccomp \+ cgroup"):
            _line(out, rf"layers {name} +: +{NUMBER} snippets/s +\( *{NUMBER}x\)")
        _line(out, rf"executor over HTTP +: +{NUMBER} snippets/s")


@pytest.mark.model  # trains a base model's first step
def test_bench_base_smallest():
    out = _run("bench_base.py", "--presets", "ci", "--steps", "1", "--threads", "1")
    _line(out, r"torch \S+, 1 threads$")
    row = json.loads(_line(out, r"\{.*\}$").group(0))
    assert row["preset"] == "ci" and row["tokens_per_second_median"] > 0
    assert row["predicted_train_seconds"] > 0


def test_bench_pac_smallest(ci_base_cache):
    # m = 2 is the smallest ensemble a worlds artifact may hold.
    out = _run(
        "bench_pac.py",
        "--preset",
        "ci",
        "--cache-dir",
        ci_base_cache,
        "--worlds",
        "2",
        "--tokens",
        "2",
        "--threads",
        "1",
        "--requests",
        "2",
    )
    _line(out, r"base ci; 2 tokens; torch threads [0-9]+$")
    _line(
        out,
        rf"2 2 requests together: {NUMBER} ms/step, {NUMBER} ms per request-token; "
        rf"{NUMBER}x one request's token rate$",
    )
    _line(
        out,
        r"m +batched ms/token +separate ms/token +one world ms/token +batched/one "
        r"+separate/batched$",
    )
    _line(out, rf"2 +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}x +{NUMBER}x$")


def test_dp_overhead_smallest(ci_model):
    # Two of its modes (a subprocess each): the DP step and the secure mode's extra draws;
    # nondp, functorch and ghost differ from hooks by one argument.
    out = _run(
        "dp_overhead.py",
        "--model",
        ci_model,
        "--batch",
        "2",
        "--length",
        "8",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--records",
        "64",
        "--threads",
        "1",
        "--modes",
        "hooks",
        "secure",
    )
    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert {"hooks", "secure"} <= rows
    assert "secure mode" in out and "/ standard hooks: step time" in out


@pytest.mark.heavy  # four subprocesses (one per part) on the tiny shape: about a minute
def test_gpu_check_smallest():
    # Without CUDA and without --device cpu it refuses, naming the CPU run (exit 2).
    import torch

    if not torch.cuda.is_available():
        proc = subprocess.run(
            [sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True
        )
        assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr
        assert "--device cpu --tiny" in proc.stderr and not proc.stdout
    # The default budget (480 s) leaves the tiny run's parts ample room even on a loaded machine.
    out = _run("gpu_check.py", "--device", "cpu", "--tiny", "--threads", "1", timeout=540)
    _line(out, r"gpu_check .*: CPU .*; shapes tiny; budget 480 s$")
    _line(out, r"fine-tune +mode +batch +first s +step s +model GiB +peak GiB +x nondp step")
    summary = out[out.index("\nsummary (") :]
    for config in ("LoRA r=8 nondp", "LoRA r=8 dp", "full nondp", "full dp"):
        row = _line(summary, rf"dp +{config} 2x16 +({NUMBER}) s/step, peak - GiB")
        assert float(row.group(1)) > 0
    _line(summary, rf"dp +full dp 2x16 .* {NUMBER}x time, - peak$")
    _line(summary, rf"generate +batch 2 x 4 new tokens +{NUMBER} tokens/s +{NUMBER}x vs batch 1$")
    _line(summary, rf"pac +one world \(1 row\) +{NUMBER} ms/token +-$")
    for m in (2, 4):
        _line(summary, rf"pac +m={m} worlds \({m + 1} rows\) +{NUMBER} ms/token +{NUMBER}x vs")
    # ZeRO-3 runs on CPU once DeepSpeed's CPU ops are built (else a row says why it did not).
    zero3 = _line(summary, r"zero3 +(ZeRO-3 .*)$").group(1)
    assert re.search(rf"tiny shape, all layers .* {NUMBER} s/step, peak - GiB, init", zero3) or (
        "skipped on CPU: DeepSpeed would JIT-compile its CPU ops" in zero3
    )
    assert "failed" not in summary and "killed" not in summary and "skipped: time" not in summary
    done = re.findall(r"^\[(\w+)\] done in [0-9]+ s$", out, re.M)
    assert done == ["dp", "generate", "pac", "zero3"]  # each part in its subprocess, in time


@pytest.mark.heavy  # a Ray cluster, Ray Serve and both apps in a subprocess: about a minute
def test_bench_serve_smallest(ci_base_cache):
    out = _run(
        "bench_serve.py",
        "--preset",
        "ci",
        "--cache-dir",
        ci_base_cache,
        "--requests",
        "3",
        "--clients",
        "1",
        "2",
        "--pac-clients",
        "1",
        "2",
        "--rounds",
        "1",
        "--worlds",
        "2",
        "--max-tokens",
        "2",
        "--burst",
        "8",
    )
    _line(out, r"^app +setting +p50 ms +p99 ms +req/s +tokens/s +errors$")
    settings = (
        "premium +1 clients",
        "premium +2 clients",
        "pac +m=2, 1 clients",
        "pac +m=2, 2 clients",
    )
    for setting in settings:
        row = _line(out, rf"^{setting} +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER}) +0$")
        assert float(row.group(3)) > 0  # requests/s
    assert float(_line(out, rf"^pac 2 clients / 1: ({NUMBER})x requests/s").group(1)) > 0
    burst = _line(out, r"^rate limit 2/s burst 5: 8 requests at once -> (\d+) x 200, (\d+) x 429")
    assert int(burst.group(1)) >= 5 and int(burst.group(1)) + int(burst.group(2)) == 8


def test_train_scaling_smallest(ray_cluster, ci_model):
    # One configuration (1 worker x 1 CPU) of 3 steps, the fewest it can time; the other two
    # differ by Ray Train's worker count and CPUs per worker.
    out = _run(
        "train_scaling.py",
        "--model",
        ci_model,
        "--configs",
        "1x1",
        "--steps",
        "3",
        "--batch",
        "4",
        "--length",
        "16",
        "--rounds",
        "1",
        "--size",
        "40",
    )
    _line(out, rf"round 1: 1 worker x 1 CPU: {NUMBER} samples/s$")
    _line(out, r"model .*; [0-9]+ records; expected batch 4; max 16 tokens; 3 steps; ")
    _line(out, r"configuration +samples/s +x 1x1$")
    _line(out, rf"1 worker x 1 CPU +{NUMBER} +1\.00$")


def test_bench_synth_smallest(ray_cluster, ci_release):
    # Both halves: the release through Ray Data and in process, then the canned generator
    # for the peak-memory ratio, at one size (equal --small and --big run once: each Ray
    # Data run costs ~20 s of actor start-up on 2 CPUs, whatever its size).
    out = _run(
        "bench_synth.py",
        "--release",
        str(ci_release),
        "--samples",
        "2",
        "--small",
        "2",
        "--big",
        "2",
    )
    _line(
        out,
        rf"throughput: ray data {NUMBER} samples/s, in-process loop {NUMBER} samples/s, "
        rf"ratio {NUMBER}x",
    )
    _line(out, rf"2 samples \(canned generator\): .* peak RSS {NUMBER} MiB")
    assert out.count("samples (canned generator)") == 1  # equal sizes: one run
    _line(out, rf"peak RSS 2 vs 2: {NUMBER}x .*; peak PSS {NUMBER}x")
    for operator in ("generate", "extract", "execution", "roundtrip"):  # the pools' telemetry
        _line(out, rf"operator {operator}: 2 rows, ")


@pytest.mark.heavy  # a bench script in a subprocess
def test_bench_roundtrip_smallest():
    out = _run("bench_roundtrip.py", "--pairs", "8", "--repeat", "1")
    _line(out, r"8 pairs \(20% repeated codes\), 1 torch thread\(s\), threshold 0\.34:")
    for name in ("before", r"\+ cache", r"\+ int8 rows", r"\+ bfloat16"):
        _line(
            out,
            rf"{name} +{NUMBER} samples/s/core +{NUMBER}x +verdicts changed [0-9]+/8 +"
            rf"max \|score diff\| {NUMBER} +held-out: kept {NUMBER}% rejected {NUMBER}% "
            rf"J -?{NUMBER}",
        )


def test_bench_ingest_smallest():
    out = _run("bench_ingest.py", "--limit-files", "8")
    _line(out, r"tree: .* \(8 \.py file\(s\)\); CPUs: [0-9]+")
    _line(out, r"records \(units\) +: +[0-9]+ found")
    _line(out, rf"total +: +{NUMBER} s +\( *{NUMBER} records/s\)")
    _line(out, rf"dedup +: +{NUMBER} s +\( *{NUMBER}% of the time\)")
