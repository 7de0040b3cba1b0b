"""``privcode budget``: the privacy store from a terminal.

``init`` creates a store (the only command that does); ``show`` prints its budget, record groups,
jobs and PAC deployments; ``raise`` raises a budget on record; ``verify`` checks the store (exit
status 1 on any problem) and records a deliberate move; ``wipe`` deletes it after recording it
outside the store; ``serve-ledger`` is its one writer over HTTP
(:mod:`privcode.privacy.ledger_service`). The store is ``--store``, else
``PRIVCODE_PRIVACY_STORE``, else the config's ``privacy.store``, else the default store (never
from ``run.out_dir``). Commands and options: docs/privacy.md, "privcode/privacy/cli.py".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from privcode.config import load_config
from privcode.errors import PrivcodeError
from privcode.privacy.authority import default_key_path
from privcode.privacy.store import resolve_store


def _json(obj: object) -> None:
    print(json.dumps(obj, sort_keys=True, default=str))


def _store(args: argparse.Namespace) -> Path:

    if args.store:
        return Path(args.store).expanduser().resolve()
    cfg = load_config(args.config, args.overrides)
    return resolve_store(cfg.privacy.store)


def cmd_budget_init(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import init_store
    from privcode.privacy.ledger import Budget

    if args.epsilon is None and (args.delta is not None or args.accountant is not None):
        raise PrivcodeError("budget init: --delta and --accountant go with --epsilon E")
    budget = None
    if args.epsilon is not None:
        budget = Budget(
            args.epsilon,
            1e-5 if args.delta is None else args.delta,
            args.accountant or "rdp",
        )
    store, created = init_store(
        _store(args),
        budget,
        if_absent=args.if_absent,
        replace_lost=args.replace_lost,
        authority_key=args.authority_key,
    )
    info = {"store": str(store.root), "store_id": store.store_id, "created": created}
    if args.json:
        _json({**info, "budget": budget.to_dict() if budget else None})
    elif created:
        what = (
            f"budget epsilon {budget.epsilon:g} per record at delta {budget.delta:g}"
            if budget
            else "no budget yet: the first DP job sets it"
        )
        print(f"created the privacy store {store.root} (id {store.store_id}; {what})")
        key = args.authority_key or default_key_path(store.store_id)
        print(f"its authority key (raises budgets; keep it off the cluster): {key}")
    else:
        print(f"privacy store {store.root} (id {store.store_id}) already exists")
    return 0


def cmd_budget_show(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import call, format_show

    shown = call(_store(args), "show")
    _json(shown) if args.json else print(format_show(shown))
    return 0


def cmd_budget_raise(args: argparse.Namespace) -> int:
    """Sign a raise with the store's authority and deliver it (``raise``), deliver a grant
    signed elsewhere (``raise --grant FILE``), or only sign it (``sign-raise``)."""
    from privcode.privacy.budget import call
    from privcode.privacy.raising import raise_with_authority

    if args.action == "raise" and args.grant:
        grant = json.loads(Path(args.grant).read_text(encoding="utf-8"))
        kind = (grant.get("message") or {}).get("kind") if isinstance(grant, dict) else None
        info = call(_store(args), "pac_raise" if kind == "pac" else "raise_budget", grant)
        _json(info) if args.json else print(f"delivered the grant {args.grant}")
        return 0
    if (args.epsilon is None) == (args.pac is None) or (args.pac and args.nats is None):
        raise PrivcodeError(
            f"budget {args.action}: give --epsilon E (records) or --pac WORLDS --nats N"
            + (", or --grant FILE" if args.action == "raise" else "")
        )
    if not (args.who and args.why):
        raise PrivcodeError(f"budget {args.action}: --who and --why say who raises it and why")
    to = args.epsilon if args.pac is None else args.nats
    deliver = args.action == "raise"
    info = raise_with_authority(
        _store(args),
        args.authority_key,
        to=to,
        who=args.who,
        why=args.why,
        worlds=args.pac,
        deliver=deliver,
    )
    if not deliver:
        text = json.dumps(info, sort_keys=True, indent=2) + "\n"
        if args.out:
            Path(args.out).write_text(text, encoding="utf-8")
            print(f"signed grant written to {args.out} (deliver: privcode budget raise --grant)")
        else:
            print(text, end="")
        return 0
    what = (
        f"PAC worlds {args.pac} may spend {info['allowance_nats']:g} nats"
        if args.pac
        else f"privacy budget raised to epsilon {info['budget']['epsilon']:g} per record"
    )
    _json(info) if args.json else print(f"{what} (logged: who {args.who!r}, why {args.why!r})")
    return 0


def cmd_budget_authority(args: argparse.Namespace) -> int:
    from privcode.privacy.raising import add_authority

    path = add_authority(_store(args), args.authority_key)
    print(f"the store's authority key (raises budgets; keep it off the cluster): {path}")
    return 0


def cmd_budget_verify(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import format_verify, verify_store

    result = verify_store(_store(args), accept_move=args.accept_move)
    _json(result) if args.json else print(format_verify(result))
    return 0 if result["ok"] else 1


def cmd_budget_wipe(args: argparse.Namespace) -> int:
    from privcode.privacy.budget import wipe

    record = wipe(_store(args), args.confirm or "", why=args.why or "")
    if args.json:
        _json(record)
    else:
        spent = record.get("epsilon_spent")
        print(
            f"deleted the privacy store {record['path']} (id {record.get('store_id')}; worst "
            f"record epsilon {'unknown' if spent is None else f'{spent:.4g}'}): every budget in "
            f"it is gone. Recorded in {record['log']}:"
        )
        print(json.dumps({k: v for k, v in record.items() if k != "log"}, sort_keys=True))
    return 0


def cmd_budget_serve_ledger(args: argparse.Namespace) -> int:
    from privcode.privacy.ledger_service import serve_ledger

    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise PrivcodeError(f"budget serve-ledger: --listen HOST:PORT, got {args.listen!r}")
    serve_ledger(_store(args), args.tokens, host=host, port=int(port))
    return 0


def add_budget_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "budget",
        help="The privacy store: create, per-record budgets spent and left, raise, verify, wipe.",
    )
    bsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, func, help_text in (
        ("init", cmd_budget_init, "Create a privacy store (the only command that does)."),
        ("show", cmd_budget_show, "Budget, record groups, jobs: epsilon (RDP, PRV) spent, left."),
        (
            "raise",
            cmd_budget_raise,
            "Raise the per-record epsilon budget, signed by the store's authority (logged: "
            "who, why).",
        ),
        ("sign-raise", cmd_budget_raise, "Sign a raise for delivery elsewhere (--out FILE)."),
        ("authority", cmd_budget_authority, "Give a store from before authorities its key."),
        (
            "verify",
            cmd_budget_verify,
            "Check the store (key, identity, hash chain, head, job records, groups); exit 1 "
            "on any problem.",
        ),
        ("wipe", cmd_budget_wipe, "Delete a store and every budget in it, on record."),
        (
            "serve-ledger",
            cmd_budget_serve_ledger,
            "Be the store's one writer over HTTP (a Kubernetes release's ledger Deployment).",
        ),
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
        d.add_argument(
            "--store",
            default=None,
            help="The store directory (overrides PRIVCODE_PRIVACY_STORE and --config).",
        )
        d.add_argument("--json", action="store_true", help="Print one JSON object.")
        if action == "init":
            d.add_argument("--epsilon", type=float, help="Set the per-record budget now.")
            d.add_argument("--delta", type=float, help="Its delta (default 1e-5).")
            d.add_argument("--accountant", choices=("rdp", "prv"), help="Default rdp.")
            d.add_argument(
                "--if-absent",
                action="store_true",
                help="A store already there is fine (make demo); a lost one is still refused.",
            )
            d.add_argument(
                "--replace-lost",
                action="store_true",
                help="Start a new store where one was lost without a wipe (recorded).",
            )
        if action in ("init", "raise", "sign-raise", "authority"):
            d.add_argument(
                "--authority-key",
                default=None,
                help="The store authority's private key (default ~/.config/privcode/"
                "authority/<store id>.key; never where a pipeline job can read it).",
            )
        if action in ("raise", "sign-raise"):
            d.add_argument("--epsilon", type=float, help="The new, higher per-record budget.")
            d.add_argument("--pac", metavar="WORLDS_ID", help="Raise a PAC deployment instead.")
            d.add_argument("--nats", type=float, help="The PAC worlds' new, higher allowance.")
            d.add_argument("--who", help="Who decides (kept in the store's log).")
            d.add_argument("--why", help="Why (kept in the store's log).")
        if action == "raise":
            d.add_argument("--grant", help="Deliver a grant signed by `budget sign-raise`.")
        if action == "sign-raise":
            d.add_argument("--out", help="Write the grant here (default: stdout).")
        if action == "verify":
            d.add_argument(
                "--accept-move",
                action="store_true",
                help="The store was moved here on purpose: record the move (its log, its "
                "identity, the store log).",
            )
        if action == "serve-ledger":
            d.add_argument(
                "--listen", default="127.0.0.1:8790", help="HOST:PORT (default 127.0.0.1:8790)."
            )
            d.add_argument(
                "--tokens",
                required=True,
                help="Directory of one bearer token file per role (pipeline, serving, operator).",
            )
        if action == "wipe":
            d.add_argument("--confirm", default=None, help="The store's path, repeated.")
            d.add_argument("--why", default="", help="Why (kept in the record of the wipe).")
        d.set_defaults(func=func)
