"""The privcode operator: PrivCodeRun and PrivacyBudget on Kubernetes (kopf).

``privcode operator --store S --data-root D --template T`` runs the
controller (:mod:`privcode.operator.controller`); a run's spec is
:mod:`privcode.operator.spec`, its admission before any pod
:mod:`privcode.operator.admission`, its children
:mod:`privcode.operator.children`. The chart deploys it; docs/kubernetes.md
("Running privcode as an operator") says what is enforced where.
"""
