"""``privcode dp``: accounting by hand (epsilon of a DP-SGD run, noise calibration)."""

from __future__ import annotations

import argparse
import json


def _json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


def _settings(args: argparse.Namespace) -> dict[str, object]:
    """The accounting settings both commands print: accountant, delta, q and T."""
    keys = ("accountant", "delta", "sample_rate", "steps")
    return {key: getattr(args, key) for key in keys}


def cmd_dp_epsilon(args: argparse.Namespace) -> int:
    from privcode.dp.accounting import DPEvent, epsilon

    event = DPEvent(
        noise_multiplier=args.noise_multiplier, sample_rate=args.sample_rate, steps=args.steps
    )
    eps = epsilon([event], delta=args.delta, accountant=args.accountant)
    out = {"epsilon": eps, "noise_multiplier": args.noise_multiplier, **_settings(args)}
    _json(out) if args.json else print(
        f"epsilon = {eps:.4f} ({args.accountant}, delta {args.delta:g})"
    )
    return 0


def cmd_dp_calibrate(args: argparse.Namespace) -> int:
    from privcode.dp.accounting import DPEvent, calibrate, epsilon

    sigma = calibrate(
        args.epsilon,
        delta=args.delta,
        sample_rate=args.sample_rate,
        steps=args.steps,
        accountant=args.accountant,
    )
    eps = epsilon(
        [DPEvent(sigma, args.sample_rate, args.steps)], delta=args.delta, accountant=args.accountant
    )
    out = {"noise_multiplier": sigma, "epsilon": eps, "target_epsilon": args.epsilon}
    out.update(_settings(args))
    _json(out) if args.json else print(
        f"noise_multiplier = {sigma:.6f} (epsilon {eps:.4f} <= {args.epsilon})"
    )
    return 0


def add_dp_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dp", help="Privacy accounting: epsilon of a DP-SGD run, noise calibration.")
    dpsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, func, help_text in (
        ("epsilon", cmd_dp_epsilon, "Epsilon of T steps of DP-SGD at sample rate q, noise sigma."),
        ("calibrate", cmd_dp_calibrate, "Smallest noise multiplier meeting a target epsilon."),
    ):
        d = dpsub.add_parser(action, help=help_text)
        d.add_argument("--sample-rate", type=float, required=True, help="Poisson sample rate q.")
        if action == "epsilon":
            d.add_argument("--noise-multiplier", type=float, required=True, help="Noise sigma / C.")
        else:
            d.add_argument("--epsilon", type=float, required=True, help="Target epsilon.")
        d.add_argument("--steps", type=int, required=True, help="Number of steps T.")
        d.add_argument("--delta", type=float, default=1e-5, help="Delta (default %(default)s).")
        d.add_argument(
            "--accountant",
            choices=("rdp", "prv"),
            default="rdp",
            help="Accountant (default %(default)s).",
        )
        d.add_argument("--json", action="store_true", help="Print one JSON object.")
        d.set_defaults(func=func)
