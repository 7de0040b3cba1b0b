"""Serving: Ray Serve apps with an OpenAI-compatible HTTP API (FastAPI ingresses).

* :mod:`privcode.serve.premium`: the premium model (``import_path:
  privcode.serve.premium:app``), and :class:`~privcode.serve.premium.PremiumModel`,
  its model-running core usable without Ray.
* :mod:`privcode.serve.ensemble`: the PAC-private ensemble of m worlds
  (``import_path: privcode.serve.ensemble:app``), one replica; its args in
  :mod:`~privcode.serve.pac_args`, its API core (sessions, budgets per key) in
  :mod:`~privcode.serve.pac_service`.
* :mod:`privcode.serve.api`: the typed requests and answers both apps share, and the
  FastAPI app they build on; :mod:`privcode.serve.guard`: API keys per client, rate limits,
  body caps; :mod:`privcode.serve.args`: the apps' args, from the ``serve`` config section.
"""
