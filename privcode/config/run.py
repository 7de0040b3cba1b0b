"""The ``run`` section: which stages run, where their outputs go, which Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class RunConfig:
    """Which stages to run, where artifacts and reports go, which Ray cluster to use."""

    name: str = opt(
        "demo",
        "Run name: artifacts go to <out_dir>/<name>/, the report to <reports_dir>/<name>/.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
    )
    stages: tuple[str, ...] = opt(
        ("data", "base", "report"), "Stages to run, in this order.", min_len=1
    )
    out_dir: str = opt("runs", "Root directory of stage artifacts (a PVC mount on Kubernetes).")
    reports_dir: str = opt("reports", "Root directory of reports.")
    ray_address: str = opt(
        "",
        "Ray cluster to run stages on: '' uses RAY_ADDRESS or starts "
        "an in-process local cluster; 'auto' joins a running local head.",
    )
    force: bool = opt(False, "Re-run every stage even when its inputs and config are unchanged.")
    parallel: bool = opt(
        True,
        "Start a stage as soon as the stages it reads are done, so "
        "independent stages share the cluster; false: one at a time.",
    )
