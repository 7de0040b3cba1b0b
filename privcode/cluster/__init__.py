"""Ray cluster plumbing: a local head on 127.0.0.1, the driver connection, Jobs API submission.

* :mod:`privcode.cluster.local`: ``start_head`` / ``stop_head`` / ``head_status``
  and ``connect`` (the one place privcode calls ``ray.init``).
* :mod:`privcode.cluster.ray_env`: the token-auth helpers (``auth_headers``,
  ``ensure_token``) and the processes' environment (``prepare_driver_env``,
  ``head_env``, ``apply_process_env``).
* :mod:`privcode.cluster.jobs`: ``submit_pipeline`` and the lower-level
  ``submit_job`` / ``wait_for_job`` / ``job_logs`` on the Ray Jobs API.

Submodules are imported on demand (``from privcode.cluster import local``) so
that importing this package does not import Ray.
"""
