"""``privcode budget``: the privacy store from a terminal.

``privcode budget show [--json]`` prints the store's budget, its record groups
(the records trained on by the same jobs, their number and epsilon under RDP
and PRV), its jobs and its PAC deployments; ``budget raise --epsilon E --who
NAME --why REASON`` raises the per-record budget on record in the store's log
(``--pac WORLDS_ID --nats N``: a PAC deployment's allowance); ``budget wipe
--confirm PATH`` deletes a local demo store (every spent budget in it). The
store is ``--store``, else the config's (``privacy.store``,
``PRIVCODE_PRIVACY_STORE``, or ``privacy-store/`` beside ``run.out_dir``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from privcode.config import load_config


def _json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


def _store(args: argparse.Namespace) -> Path:
    from privcode.privacy.store import resolve_store

    if args.store:
        return Path(args.store).resolve()
    cfg = load_config(args.config, args.overrides)
    return resolve_store(cfg.privacy.store, cfg.run.out_dir)


def cmd_budget_show(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import call, format_show

    shown = call(_store(args), "show")
    _json(shown) if args.json else print(format_show(shown))
    return 0


def cmd_budget_raise(args: argparse.Namespace) -> int:
    from privcode.errors import PrivcodeError
    from privcode.privacy.budget import call

    if (args.epsilon is None) == (args.pac is None):
        raise PrivcodeError("budget raise: give --epsilon E (records) or --pac WORLDS --nats N")
    if args.pac is not None:
        if args.nats is None:
            raise PrivcodeError("budget raise --pac WORLDS needs --nats N")
        info = call(_store(args), "pac_raise", args.pac, args.nats, args.who, args.why)
        what = f"PAC worlds {args.pac} may spend {info['allowance_nats']:g} nats"
    else:
        info = call(_store(args), "raise_budget", args.epsilon, args.who, args.why)
        what = f"privacy budget raised to epsilon {info['budget']['epsilon']:g} per record"
    _json(info) if args.json else print(f"{what} (logged: who {args.who!r}, why {args.why!r})")
    return 0


def cmd_budget_wipe(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import wipe

    path = wipe(_store(args), args.confirm or "")
    print(f"deleted the privacy store {path}: every budget in it starts afresh")
    return 0


def add_budget_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "budget", help="The privacy store: per-record budgets spent and left, raise, wipe."
    )
    bsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, func, help_text in (
        ("show", cmd_budget_show, "Budget, record groups, jobs: epsilon (RDP, PRV) spent, left."),
        ("raise", cmd_budget_raise, "Raise the per-record epsilon budget (logged: who, why)."),
        ("wipe", cmd_budget_wipe, "Delete a local demo store and every budget in it."),
    ):
        d = bsub.add_parser(action, help=help_text)
        d.add_argument(
            "--config", default="jobs/configs/demo.yaml", help="Config naming the store."
        )
        d.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="K=V",
            help="Config override (repeatable).",
        )
        d.add_argument("--store", default=None, help="The store directory (overrides --config).")
        d.add_argument("--json", action="store_true", help="Print one JSON object.")
        if action == "raise":
            d.add_argument("--epsilon", type=float, help="The new, higher per-record budget.")
            d.add_argument("--pac", metavar="WORLDS_ID", help="Raise a PAC deployment instead.")
            d.add_argument("--nats", type=float, help="The PAC worlds' new, higher allowance.")
            d.add_argument("--who", required=True, help="Who decides (kept in the store's log).")
            d.add_argument("--why", required=True, help="Why (kept in the store's log).")
        if action == "wipe":
            d.add_argument("--confirm", default=None, help="The store's path, repeated.")
        d.set_defaults(func=func)
