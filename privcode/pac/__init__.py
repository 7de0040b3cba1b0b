"""PAC-private generation (METHODS.md section 5, seed 004).

:mod:`privcode.pac.bounds`: the mechanism's pure maths: what a
mutual-information budget means for an attacker (membership-inference and
world-identification success bounds), the anisotropic PAC noise rule, and
the posterior-entropy leakage estimate.
"""
