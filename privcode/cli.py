"""The ``privcode`` command line: one subcommand per stage, each a thin wrapper.

:func:`build_parser` only wires one ``add_<command>_parser`` per command; the
packages with a command group of their own (serve, audit probe, data ingest,
sandbox, eval, dp, budget, operator) bring their ``add_*_parser``. Handlers import
their stage inside (ray, torch, transformers, pyarrow: 50 ms to 2 s) so that
``privcode --help`` and config errors answer instantly.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from privcode import __version__
from privcode.audit.probe.cli import add_probe_parser
from privcode.cluster import jobs, k8s, local
from privcode.cluster.ray_env import apply_process_env
from privcode.config import SECTIONS, describe, load_config
from privcode.data.ingest.cli import add_ingest_parser
from privcode.dp.cli import add_dp_parser
from privcode.errors import PrivcodeError
from privcode.eval.cli import add_eval_parser
from privcode.layout import RunLayout
from privcode.operator.cli import add_operator_parser
from privcode.pipeline.plan import parse_node, plan_pipeline
from privcode.pipeline.runner import run_pipeline
from privcode.pipeline.study import write_results
from privcode.privacy.cli import add_budget_parser
from privcode.sandbox.cli import add_sandbox_parser
from privcode.serve.cli import add_serve_parser


def _add_config_args(
    p: argparse.ArgumentParser, default: str | None = "jobs/configs/demo.yaml"
) -> None:
    p.add_argument("--config", default=default, help="Pipeline config YAML (default: %(default)s).")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="Override one config value, e.g. --set data.size=200 (repeatable).",
    )


def _print_json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


def _config_with_flags(args: argparse.Namespace, section: str, flags: tuple[str, ...]):
    """Load --config with --set overrides, then the command's own flags on top."""
    overrides = list(args.overrides)
    overrides += [
        f"{section}.{flag}={getattr(args, flag)}"
        for flag in flags
        if getattr(args, flag) is not None
    ]
    return load_config(args.config, overrides)


# --------------------------------------------------------------------------- handlers


def cmd_run(args: argparse.Namespace) -> int:

    cfg = load_config(args.config, args.overrides)
    result = run_pipeline(cfg, stages=args.stages or None)
    if args.json:
        _print_json(result)
    else:
        _print_reports(result)
    return 0


def _print_reports(result: dict) -> None:
    if result.get("summary"):
        print(result["summary"])
        return
    if result.get("report"):
        print(f"report: {result['report']} (and report.html; aggregates only, shareable)")
    if result.get("private_report"):
        print(
            f"owner-only report: {result['private_report']} (PRIVATE: per-record plots and "
            "exact corpus counts; do not share)"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    """Print (or --json) what the config asks of a cluster; nothing runs (privcode.pipeline.plan)."""

    cfg = load_config(args.config, args.overrides)
    nodes = [n for spec in args.node for n in parse_node(spec)] or None
    if nodes is None and args.address:
        from privcode.cluster.local import connect

        connect(args.address)  # plan_pipeline then reads ray.nodes() and the autoscaler's groups
    plan = plan_pipeline(cfg, nodes=nodes, records=args.records, stages=args.stages or None)
    if args.json:
        _print_json(plan.to_json())
    else:
        print(plan.format())
    return 0 if plan.placeable is not False else 1


def cmd_config_show(args: argparse.Namespace) -> int:
    if args.config:
        cfg = load_config(args.config, args.overrides)
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    for name, cls in SECTIONS.items():
        print(f"[{name}]  {(cls.__doc__ or '').strip().splitlines()[0]}")
        for key, tp, default, help_text in describe(cls):
            print(f"  {key} ({tp}, default {default!r})\n      {help_text}")
    return 0


def cmd_data_demo(args: argparse.Namespace) -> int:
    cfg = _config_with_flags(args, "data", ("seed", "size"))
    if cfg.data.source == "ingest":
        raise PrivcodeError("data.source is ingest: build that corpus with `privcode data ingest`")
    if cfg.data.source == "company":
        from privcode.data.company import build_company_corpus as build
    else:
        from privcode.data.demo import build_demo_corpus as build
    manifest = build(Path(args.out), cfg.data)
    if args.json:
        _print_json(manifest)
    else:
        counts = manifest.get("counts", {})
        print(f"wrote {args.out}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0


def cmd_data_validate(args: argparse.Namespace) -> int:
    from privcode.data.records import read_records

    records = read_records(args.file, max_record_bytes=args.max_record_bytes)
    _print_json({"file": args.file, "records": len(records), "valid": True})
    return 0


def cmd_base_build(args: argparse.Namespace) -> int:
    from privcode.models.base import build_base

    cfg = _config_with_flags(args, "base", ("preset", "seed"))
    info = build_base(cfg.base, out_dir=Path(args.out) if args.out else None)
    _print_json(info) if args.json else print(
        f"base model at {info['path']} (held-out loss {info['heldout_loss']:.3f})"
    )
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:

    if args.action == "up":
        info = local.start_head(
            port=args.port, dashboard_port=args.dashboard_port, num_cpus=args.num_cpus
        )
        _print_json(info) if args.json else print(
            f"Ray head at {info['address']}; dashboard {info['dashboard_url']}"
        )
    elif args.action == "down":
        local.stop_head(port=args.port)
        print("Ray head stopped")
    elif args.action == "status":
        _print_json(local.head_status())
    return 0


def cmd_submit(args: argparse.Namespace) -> int:

    if args.target == "k8s":
        result = k8s.submit_pipeline_k8s(
            args.config,
            args.overrides,
            namespace=args.namespace,
            release=args.release,
            values_files=args.values,
            context=args.context,
            crds=args.crds,
            follow=not args.no_wait,
            stages=args.stages or (),
            data_claim=args.data_claim,
            data_path=args.data_path,
        )
    else:
        address = jobs.target_address(args.target, args.address)
        result = jobs.submit_pipeline(
            config=args.config,
            address=address,
            overrides=args.overrides,
            follow=not args.no_wait,
            stages=args.stages or (),
        )
    if args.json:  # otherwise the job id, URL and final status are already on stderr
        _print_json(result)
    return 0 if result["status"] in ("SUCCEEDED", "PENDING", "RUNNING", "SUBMITTED") else 1


def _stage_command(stage: str, section: str, flags: tuple[str, ...]):
    """A handler running one pipeline stage (and what it needs), with its flags as overrides."""

    def handler(args: argparse.Namespace) -> int:

        result = run_pipeline(_config_with_flags(args, section, flags), stages=[stage])
        if args.json:
            _print_json(result)
        return 0

    return handler


def cmd_report(args: argparse.Namespace) -> int:
    """The report stage alone, always re-rendered: other runs (a sweep) change what it shows."""

    cfg = load_config(args.config, [*args.overrides, "run.force=true"])
    result = run_pipeline(cfg, stages=["report"])
    if args.json:
        _print_json(result)
    else:
        _print_reports(result)
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    """docs/results.md from the study's runs (manifests only): table, plot, directions."""

    cfg = load_config(args.config, list(args.overrides))
    path = write_results(
        RunLayout.of(cfg).out_dir, list(args.runs), args.out, args.notes, args.reference
    )
    print(f"study: {path} (and {path.stem}_privacy_utility.png)")
    return 0


cmd_train = _stage_command("train", "train", ("method",))
cmd_synthesize = _stage_command("synth", "synth", ("release", "num_samples"))
cmd_premium = _stage_command("premium", "premium", ("model", "data"))
cmd_audit = _stage_command("audit", "audit", ())
cmd_pac = _stage_command("pac", "pac", ())


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``privcode`` parser: one ``add_<command>_parser`` per command, in help order."""
    parser = argparse.ArgumentParser(
        prog="privcode",
        description="Differentially private code LLMs on Ray: private corpus -> DP junior model "
        "-> synthetic data -> premium model, with audits and a report.",
    )
    parser.add_argument("--version", action="version", version=f"privcode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(sub)
    add_plan_parser(sub)
    add_config_parser(sub)
    add_data_parser(sub)
    add_base_parser(sub)
    add_train_parser(sub)
    add_synthesize_parser(sub)
    add_premium_parser(sub)
    add_serve_parser(sub, _add_config_args)
    add_audit_parser(sub)
    add_pac_parser(sub)
    add_report_parser(sub)
    add_study_parser(sub)
    add_sandbox_parser(sub)
    add_eval_parser(sub)
    add_dp_parser(sub)
    add_budget_parser(sub)
    add_operator_parser(sub)
    add_cluster_parser(sub)
    add_submit_parser(sub)
    return parser


def _add_json_flag(p: argparse.ArgumentParser, what: str = "the run summary as JSON") -> None:
    p.add_argument("--json", action="store_true", help=f"Print {what}.")


def _stage_parser(
    sub: argparse._SubParsersAction,
    name: str,
    func: Callable[[argparse.Namespace], int],
    help: str,
    json_what: str = "the run summary as JSON",
) -> argparse.ArgumentParser:
    """A pipeline command's parser: ``--config``, ``--set`` and ``--json``, run by ``func``."""
    p = sub.add_parser(name, help=help)
    _add_config_args(p)
    _add_json_flag(p, json_what)
    p.set_defaults(func=func)
    return p


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub, "run", cmd_run, "Run the configured pipeline stages in order (skips unchanged ones)."
    )
    p.add_argument("--stages", nargs="+", help="Run only these stages (default: run.stages).")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "plan",
        cmd_plan,
        "Without running any model: each stage's Ray resources and workers, whether the "
        "cluster can place them, the train stage's q, sigma and epsilon, and an estimate of "
        "its memory per worker. Exit code 1 when a stage cannot be placed.",
        json_what="the plan as JSON",
    )
    p.add_argument("--stages", nargs="+", help="Plan only these stages (default: run.stages).")
    p.add_argument(
        "--records",
        type=int,
        default=None,
        metavar="N",
        help="Training records N for q = B / N (default: the data stage's manifest count).",
    )
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="SPEC",
        help="A node of the cluster to plan for, e.g. CPU=8,GPU=1,count=8 (repeatable).",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Plan for this running Ray cluster (GCS host:port or 'auto'; no --node).",
    )


def add_config_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config", help="Show config sections, their fields and help, or a resolved config."
    )
    csub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = csub.add_parser("show", help="Print every field with its help (or a resolved --config).")
    _add_config_args(c, default=None)
    c.set_defaults(func=cmd_config_show)


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "data", help="Private data: ingest your code, build the demo corpus, validate a file."
    )
    dsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    d = dsub.add_parser(
        "demo",
        help="Build a demo corpus (data.source: company = the Acme company's code, "
        "demo = stdlib functions; PII, in-place canaries).",
    )
    d.add_argument("--out", required=True, help="Output directory.")
    d.add_argument("--seed", type=int, help="Random seed (overrides data.seed).")
    d.add_argument("--size", type=int, help="Number of ordinary records (overrides data.size).")
    _add_json_flag(d, "the manifest as JSON")
    _add_config_args(d, default=None)
    d.set_defaults(func=cmd_data_demo)
    add_ingest_parser(dsub, _add_config_args)
    d = dsub.add_parser("validate", help="Validate a JSONL or Parquet dataset row by row.")
    d.add_argument("file", help="Dataset file (.jsonl or .parquet).")
    d.add_argument("--max-record-bytes", type=int, default=65_536, help="Size limit per record.")
    d.set_defaults(func=cmd_data_validate)


def add_base_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("base", help="The public base model trained offline from public code.")
    bsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = bsub.add_parser(
        "build", help="Train tokenizer + small Qwen2 LM on public stdlib code (cached)."
    )
    b.add_argument(
        "--preset", choices=("ci", "demo", "small"), help="Size preset (overrides base.preset)."
    )
    b.add_argument("--seed", type=int, help="Seed (overrides base.seed).")
    b.add_argument("--out", help="Output directory (default: the cache directory).")
    _add_json_flag(b, "the build info as JSON")
    _add_config_args(b, default=None)
    b.set_defaults(func=cmd_base_build)


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "train",
        cmd_train,
        "Stage I: DP-SGD training of the junior model (runs the train "
        "stage and whatever it needs).",
    )
    p.add_argument("--method", help="Training method (overrides train.method), e.g. dpft.")


def add_synthesize_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "synthesize",
        cmd_synthesize,
        "Stage II: synthesise (prompt, code) pairs from the "
        "released DP artifact on Ray Data (the synth stage).",
    )
    p.add_argument(
        "--release",
        help="Release directory (overrides synth.release; default: the "
        "train stage's release/). Never a private dataset.",
    )
    p.add_argument(
        "--num-samples",
        dest="num_samples",
        type=int,
        help="Samples to generate (overrides synth.num_samples).",
    )


def add_premium_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "premium",
        cmd_premium,
        "Fine-tune the premium model (LoRA, no DP) on the synthetic data (the premium stage).",
    )
    p.add_argument(
        "--model", help="Premium base: local HF model dir or preset (overrides premium.model)."
    )
    p.add_argument("--data", help="Synthetic Parquet (overrides premium.data).")


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "audit",
        cmd_audit,
        "Privacy audits of a trained run (canary leakage, "
        "exposure, membership inference, fidelity, leak probing); "
        "`audit probe` runs leak probing alone on any model.",
    )
    asub = p.add_subparsers(dest="audit_command", required=False, metavar="AUDIT")
    add_probe_parser(asub)


def add_pac_parser(sub: argparse._SubParsersAction) -> None:
    _stage_parser(
        sub,
        "pac",
        cmd_pac,
        "PAC-private generation: train the m LoRA worlds (WITHOUT "
        "DP: served only through the PAC curator) and measure "
        "utility and leakage; `privcode serve --pac` serves them.",
    )


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    _stage_parser(
        sub,
        "report",
        cmd_report,
        "Write reports/<run>/report.md and report.html from the "
        "run's stage manifests (re-rendered every time: other "
        "runs' epsilons feed its privacy-utility curve).",
    )


def add_study_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "study",
        help="Write the study's results (docs/results.md: pass@1 with intervals, leakage, "
        "and the seeds' directions judged) from runs already trained and evaluated "
        "(`make study` trains them).",
    )
    _add_config_args(p)
    p.add_argument("--runs", nargs="+", required=True, help="Run names (under run.out_dir).")
    p.add_argument("--out", default="docs/results.md", help="Markdown file to write.")
    p.add_argument("--notes", default="", help="A paragraph put above the table.")
    p.add_argument(
        "--reference",
        default=None,
        help="A run read for the base model and the non-DP comparison only (the demo's).",
    )
    p.set_defaults(func=cmd_study)


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="A local Ray head on 127.0.0.1: up, down, status.")
    p.add_argument("action", choices=("up", "down", "status"), help="What to do.")
    p.add_argument("--port", type=int, default=6379, help="GCS port (default %(default)s).")
    p.add_argument(
        "--dashboard-port", type=int, default=8265, help="Dashboard port (default %(default)s)."
    )
    p.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)."
    )
    _add_json_flag(p, "JSON")
    p.set_defaults(func=cmd_cluster)


def add_submit_parser(sub: argparse._SubParsersAction) -> None:
    p = _stage_parser(
        sub,
        "submit",
        cmd_submit,
        "Submit the pipeline as a Ray Job (local head, any Ray "
        "cluster, or a KubeRay RayJob) and follow it.",
        json_what="JSON",
    )
    p.add_argument(
        "--target",
        choices=("local", "ray", "k8s"),
        default="local",
        help="local: the local head (started if absent; default); ray: the cluster at "
        "--address / RAY_ADDRESS; k8s: a RayJob in the current kube context, "
        "rendered from charts/privcode.",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster address for --target ray (dashboard URL or GCS host:port; "
        "default RAY_ADDRESS).",
    )
    p.add_argument("--stages", nargs="+", help="Run only these stages (default: run.stages).")
    _add_k8s_submit_args(p)
    p.add_argument("--no-wait", action="store_true", help="Return after submitting.")


def _add_k8s_submit_args(p: argparse.ArgumentParser) -> None:
    """``submit``'s options for ``--target k8s``."""
    p.add_argument(
        "--namespace",
        default=None,
        help="k8s: namespace (default: the kube context's, else 'default').",
    )
    p.add_argument(
        "--release",
        default="privcode",
        help="k8s: Helm release name the objects are named after (default %(default)s).",
    )
    p.add_argument(
        "--values",
        action="append",
        default=[],
        metavar="FILE",
        help="k8s: extra chart values file (image, storage, worker groups; repeatable).",
    )
    p.add_argument("--context", default=None, help="k8s: kube context (default: the current one).")
    p.add_argument(
        "--crds",
        default=None,
        metavar="PATH",
        help="k8s: validate against these KubeRay CRD files instead of the cluster's.",
    )
    p.add_argument(
        "--data-claim",
        default=None,
        help="k8s with the privcode operator: the PVC holding the training records (the "
        "submission is then a PrivCodeRun, admitted before any pod exists).",
    )
    p.add_argument("--data-path", default=None, help="The training file, relative to the claim.")


def main(argv: list[str] | None = None) -> int:
    apply_process_env()  # before torch is imported (handlers import it)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except PrivcodeError as exc:
        print(f"privcode: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
