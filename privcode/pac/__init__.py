"""PAC-private generation (METHODS.md section 5, seed 004).

:mod:`privcode.pac.bounds`: the mechanism's pure maths: what a
mutual-information budget means for an attacker (membership-inference and
world-identification success bounds), the anisotropic PAC noise rule, and
the posterior-entropy leakage estimate. :mod:`privcode.pac.mechanism`:
worlds of half the corpus each, the worlds' votes, and one PAC-private
token (calibrated noise, posterior update, release).
"""
