"""``privcode operator``: run the controller (a Deployment of the chart, or a terminal).

Flags: ``--store`` (the privacy store, read for its keys), ``--data-root``
(where data claims are mounted), ``--template`` (the chart's rendered RayJob,
YAML), ``--namespace`` (repeatable; the namespaces it watches), ``--server``
(an API server URL without credentials, for a local mock; default: the pod's
service account, or the kubeconfig), ``--artifacts-root`` (the artifacts volume,
read-only: stage progress into status), ``--metrics-port``
(:mod:`privcode.operator.metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path
from typing import Any

from privcode.errors import PrivcodeError
from privcode.operator.metrics import OperatorMetrics

__all__ = ["add_operator_parser", "run_operator"]


def _api_client(server: str | None) -> Any:
    from kubernetes import client, config

    if server:
        conf = client.Configuration()
        conf.host = server
        return client.ApiClient(conf)
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def run_operator(
    *,
    store: str,
    data_root: str,
    template: dict[str, Any],
    namespaces: list[str],
    server: str | None = None,
    poll_s: float = 10.0,
    artifacts_root: str | None = None,
    metrics_port: int | None = None,
    metrics: Any = None,
    stop: threading.Event | None = None,
    ready: threading.Event | None = None,
) -> None:
    """Run the controller until ``stop`` is set (or forever); blocks."""
    import kopf

    from privcode.operator.controller import OperatorConfig, build_registry

    registry = build_registry(poll_s)
    if server:

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> Any:
            return kopf.ConnectionInfo(server=server, insecure=True)

    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True  # the namespaces are given: no cluster-wide listing
    settings.posting.level = 20  # Events from INFO up
    settings.persistence.finalizer = "privcode.dev/release"
    if metrics is None and metrics_port is not None:
        metrics = OperatorMetrics()
        metrics.serve(metrics_port)
    cfg = OperatorConfig(
        store=store,
        data_root=data_root,
        template=template,
        api=_api_client(server),
        poll_s=poll_s,
        artifacts_root=artifacts_root,
        metrics=metrics,
    )
    asyncio.run(
        kopf.operator(
            registry=registry,
            settings=settings,
            namespaces=namespaces,
            standalone=True,
            memo=kopf.Memo(config=cfg),
            stop_flag=stop,
            ready_flag=ready,
        )
    )


def cmd_operator(args: argparse.Namespace) -> int:
    import yaml

    try:
        template = yaml.safe_load(Path(args.template).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise PrivcodeError(f"operator --template {args.template}: {exc}") from None
    if not isinstance(template, dict) or template.get("kind") != "RayJob":
        raise PrivcodeError(f"operator --template {args.template}: not a RayJob manifest")
    run_operator(
        store=args.store,
        data_root=args.data_root,
        template=template,
        namespaces=args.namespace or ["default"],
        server=args.server,
        poll_s=args.poll_s,
        artifacts_root=args.artifacts_root,
        metrics_port=args.metrics_port,
    )
    return 0


def add_operator_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "operator",
        help="Run the Kubernetes controller: PrivCodeRuns admitted against the privacy store "
        "before any pod exists.",
    )
    p.add_argument("--store", required=True, help="The privacy store (read for its keys).")
    p.add_argument("--data-root", default="/mnt/data", help="Where data claims are mounted.")
    p.add_argument("--template", required=True, help="The chart's rendered RayJob (YAML).")
    p.add_argument(
        "--namespace", action="append", help="A namespace to watch (repeatable; default: default)."
    )
    p.add_argument(
        "--server", default=None, help="API server URL (a local mock); default: in-cluster."
    )
    p.add_argument("--poll-s", type=float, default=10.0, help="Status mirroring interval.")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="Serve the operator's metrics (runs by phase, admissions, reconcile errors) here.",
    )
    p.add_argument(
        "--artifacts-root",
        default=None,
        help="The artifacts volume (read-only; runs under runs/, reports under reports/): "
        "finished stages, the release digest and the report path go into each run's status.",
    )
    p.set_defaults(func=cmd_operator)
