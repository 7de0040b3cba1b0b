"""Re-capture ``tests/golden/generate.json``, the golden outputs of the six generation paths.

Run it on the code whose outputs are the reference (it was first run on the code before
``privcode.models.generate``, issue 44), from the repository root::

    .venv/bin/python tests/golden/capture_generate.py

It runs ``tests/test_generate_golden.py`` with ``PRIVCODE_GOLDEN_CAPTURE=1``: each test then
records what its path generates instead of comparing it, and the file is rewritten with the
sha256 of the ci model's weights the outputs belong to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    env = {**os.environ, "PRIVCODE_GOLDEN_CAPTURE": "1"}
    test = str(ROOT / "tests" / "test_generate_golden.py")
    sys.exit(
        subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            cwd=ROOT,
            env=env,
        )
    )
