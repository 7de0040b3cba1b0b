"""The ``sandbox`` section: where and how strongly generated code is isolated."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class SandboxConfig:
    """Isolation of the generated code that Stage II's execution filter and pass@k run."""

    isolation: str = opt(
        "full",
        "Weakest isolation accepted. full: namespaces + unprivileged uid + seccomp (+ a "
        "cgroup per snippet where writable); without it (not root, namespaces denied, no "
        "libseccomp) Stage II and eval stop with what is missing. rlimits-only: must be "
        "asked for by name; weak isolation, verdicts only, no protection; written into "
        "every verdict, the synth stats, pass@k results and the report.",
        choices=("full", "rlimits-only"),
    )
    executor: str = opt(
        "",
        "URL of the executor service (`privcode sandbox serve`; the Helm chart's executor "
        "pods) that runs the code instead of this cluster's pods; PRIVCODE_SANDBOX_EXECUTOR "
        "overrides. '' = a local sandbox pool in the Ray workers.",
    )
