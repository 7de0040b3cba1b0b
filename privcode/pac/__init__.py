"""PAC-private generation (docs/methods.md, PAC-private generation, seed 004).

* :mod:`privcode.pac.bounds`: the pure maths: what a mutual-information budget means for an
  attacker (membership-inference and world-identification success bounds), the anisotropic PAC
  noise rule, the posterior-entropy leakage estimate.
* :mod:`privcode.pac.mechanism`: worlds of half the corpus each, the worlds' votes, and one
  PAC-private token (noise, posterior, release).
* :mod:`privcode.pac.worlds`: trains the m LoRA worlds (no DP) in batched mixed-adapter passes.
* :mod:`privcode.pac.curator`: the secret realised world, the posterior and the fail-closed,
  persisted session and deployment budgets.
* :mod:`privcode.pac.ensemble`: the base once plus m adapters, one batched forward of m+1 rows
  per token, PAC-private decoding.
* :mod:`privcode.pac.evaluate`: utility, measured leakage and attack success for the ``pac``
  pipeline stage.

Served by :mod:`privcode.serve.ensemble` (Ray Serve).
"""
