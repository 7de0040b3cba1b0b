"""The ``sandbox`` section: where and how strongly generated code is isolated."""

from __future__ import annotations

from dataclasses import dataclass

from privcode.config.fields import opt


@dataclass(frozen=True)
class SandboxConfig:
    """Isolation of the generated code that Stage II's execution filter and pass@k run."""

    isolation: str = opt(
        "full",
        "Weakest isolation accepted. full: namespaces + unprivileged uid + seccomp + a cgroup "
        "per snippet (a writable cgroup, or CAP_SYS_ADMIN to mount a private one); without "
        "it (not root, namespaces denied, no libseccomp, no cgroup) Stage II and eval stop "
        "with what is missing. full-no-cgroup: must be asked for by name; the same layers "
        "without a cgroup (memory bounded per process only), written into every verdict. "
        "rlimits-only: must be asked for by name; weak isolation, verdicts only, no "
        "protection; written into every verdict, the synth stats, pass@k results and the "
        "report.",
        choices=("full", "full-no-cgroup", "rlimits-only"),
    )
    executor: str = opt(
        "",
        "URL of the executor service (`privcode sandbox serve`; the Helm chart's executor "
        "pods) that runs the code instead of this cluster's pods; PRIVCODE_SANDBOX_EXECUTOR "
        "overrides. '' = a local sandbox pool in the Ray workers.",
    )
