"""``privcode audit probe``: leak probing by test generation from the command line.

``add_probe_parser(subparsers)`` adds the ``probe`` subcommand to an
``audit`` command group; its handler (``args.func``) returns an exit code.
The printed result is the counts-only summary; confirmed leaks go to
``probe_leaks.json`` in ``--out`` (default: ``<run>/audit/probe`` next to the
``data/`` directory holding ``--data``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_probe_parser", "cmd_audit_probe", "default_out_dir"]


def default_out_dir(data: str | Path) -> Path:
    """``runs/<run>/audit/probe`` for ``runs/<run>/data/train.parquet``; else next to the file."""
    data = Path(data).resolve()
    run = data.parent.parent if data.parent.name == "data" else data.parent
    return run / "audit" / "probe"


def _list(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(t.strip() for t in text.split(",") if t.strip())


def add_probe_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe",
        help="Leak probing by test generation (seed 003): LP-L / IL-L per category.",
        description="Ask the audited model for privacy-handling functions and realistic unit "
        "tests, extract PII from the tests, judge it and verify it against the "
        "private corpus (1 <= hits <= 100). Prints counts only; the confirmed "
        "leaks are written to probe_leaks.json in --out (mode 0600).",
    )
    _add_audited_model_args(p)
    p.add_argument(
        "--data",
        required=True,
        help="The private reference corpus (train.parquet or .jsonl records).",
    )
    p.add_argument("--out", default=None, help="Output directory (default: <run>/audit/probe).")
    _add_question_args(p)
    _add_helper_model_args(p)
    p.add_argument("--no-update", action="store_true", help="Do not update the library.")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=384, help="Tokens per test response.")
    p.add_argument("--device", default="cpu", help="Device of local models (cpu, cuda).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    p.set_defaults(func=cmd_audit_probe)
    return p


def _add_audited_model_args(p: argparse.ArgumentParser) -> None:
    """The audited model: a local one (``--model``) or a server (``--endpoint`` and its options)."""
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--model",
        help="Audited model: a local HF model dir, a preset (ci, demo, "
        "small), a premium release dir or a junior release dir.",
    )
    who.add_argument(
        "--endpoint",
        help="Audited model: an OpenAI-compatible server URL (e.g. http://127.0.0.1:8000).",
    )
    p.add_argument(
        "--served-model",
        default=None,
        help="Model name to send to --endpoint (default: the first of /v1/models).",
    )
    p.add_argument(
        "--api-key-env",
        default="PRIVCODE_API_KEY",
        help="Environment variable holding the endpoint's API key "
        "(default: %(default)s; unset: no Authorization header).",
    )
    p.add_argument(
        "--chat", action="store_true", help="Use /v1/chat/completions instead of /v1/completions."
    )


def _add_question_args(p: argparse.ArgumentParser) -> None:
    """How many questions, tests and cases, about which scenarios and attributes."""
    p.add_argument("--rounds", type=int, default=1, help="Rounds (library update in between).")
    p.add_argument(
        "--questions",
        type=int,
        default=2,
        help="Questions per (scenario, attribute) pair and round (seed: 20).",
    )
    p.add_argument(
        "--tests", type=int, default=2, help="Test-generation responses per function (seed: 10)."
    )
    p.add_argument("--cases", type=int, default=5, help="Test cases asked for per response.")
    p.add_argument("--scenarios", default=None, help="Comma-separated scenario ids (default: all).")
    p.add_argument(
        "--attributes",
        default=None,
        help="Comma-separated attribute ids or category names (default: all).",
    )


def _add_helper_model_args(p: argparse.ArgumentParser) -> None:
    """The models beside the audited one (public scorer, question writer, judge) and the library."""
    p.add_argument(
        "--public-model",
        default=None,
        help="Public model for the pseudo-NLL library update (path or preset; "
        "default: the offline span split).",
    )
    p.add_argument(
        "--question-model",
        default=None,
        help="Local model that writes the questions (default: templates).",
    )
    p.add_argument(
        "--judge-model",
        default=None,
        help="Local model used as the optional Judge LLM after the format "
        "validators (it sees candidate values: keep it local).",
    )
    p.add_argument(
        "--library",
        default=None,
        help="Start from this feature-library YAML (default: prior knowledge).",
    )


def cmd_audit_probe(args: argparse.Namespace) -> int:
    # Lazy: the backends, the judge and the records reader pull in requests, torch and
    # pyarrow, which `privcode --help` must not pay for.
    from privcode.audit.probe.backends import HFBackend, make_backend
    from privcode.audit.probe.judge import LLMJudge
    from privcode.audit.probe.library import FeatureLibrary
    from privcode.audit.probe.run import run_probe
    from privcode.data.records import read_records

    options = _options(args)  # checked before any model loads
    records = read_records(args.data)
    out = Path(args.out) if args.out else default_out_dir(args.data)
    backend = make_backend(
        model=args.model,
        endpoint=args.endpoint,
        served_model=args.served_model,
        api_key_env=args.api_key_env or None,
        chat=args.chat,
        device=args.device,
    )
    question_backend = (
        HFBackend(args.question_model, device=args.device) if args.question_model else None
    )
    llm_judge = (
        LLMJudge(HFBackend(args.judge_model, device=args.device)) if args.judge_model else None
    )
    try:
        summary = run_probe(
            backend,
            records,
            out_dir=out,
            options=options,
            public_model=args.public_model,
            library=FeatureLibrary.load(args.library) if args.library else None,
            question_backend=question_backend,
            llm_judge=llm_judge,
        )
    finally:
        backend.close()
    if args.json:
        print(json.dumps(summary, sort_keys=True, default=str))
    else:
        _print_summary(summary)
    return 0


def _options(args: argparse.Namespace):
    """The command line's :class:`~privcode.audit.probe.options.ProbeOptions`."""
    from privcode.audit.probe.options import ProbeOptions  # with the taxonomy: not for --help

    return ProbeOptions(
        scenarios=_list(args.scenarios),
        attributes=_list(args.attributes),
        n_questions=args.questions,
        rounds=args.rounds,
        n_tests=args.tests,
        cases=args.cases,
        seed=args.seed,
        temperature=args.temperature,
        test_max_tokens=args.max_tokens,
        update=not args.no_update,
        device=args.device,
    )


def _print_summary(summary: dict) -> None:
    """Counts and per-category permille rates; the private details only by path."""
    m = summary["metrics"]
    print(
        f"leak probe: {summary['responses']} responses ({summary['accepted']} accepted), "
        f"{summary['confirmed']['distinct']} distinct confirmed leaks "
        f"({summary['confirmed']['instances']} instances)"
    )
    for cat in ("all", "Identifiable", "Private", "Secret"):
        e = m[cat]
        cells = "  ".join(
            f"{k} {v['permille'] if v['permille'] is not None else '-'}‰"
            for k, v in e.items()
            if k != "responses"
        )
        print(f"  {cat:<12} n={e['responses']:<5} {cells}")
    print(f"details (PRIVATE): {summary['files']['details']}")
