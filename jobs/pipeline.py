"""Ray job entry point: run the privcode pipeline on the cluster this job runs in.

Submit it through the Ray Jobs API (what ``make submit-job`` does)::

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/pipeline.py --config jobs/configs/demo.yaml

or run it directly against a running head::

    RAY_ADDRESS=127.0.0.1:6379 python jobs/pipeline.py --config jobs/configs/demo.yaml \
        --set run.out_dir=/mnt/artifacts/runs
"""

from __future__ import annotations

import sys

from privcode.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
