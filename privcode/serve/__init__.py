"""Serving: Ray Serve apps with an OpenAI-compatible HTTP API.

* :mod:`privcode.serve.premium`: the premium model (``import_path:
  privcode.serve.premium:app``), and :class:`~privcode.serve.premium.PremiumModel`,
  its model-running core usable without Ray.
* :mod:`privcode.serve.ensemble`: the PAC-private ensemble of m worlds
  (``import_path: privcode.serve.ensemble:app``): sessions with budgets, a
  curator holding the secret world; one replica.
* :mod:`privcode.serve.http`: request validation and routing, independent of
  the HTTP server.
"""
