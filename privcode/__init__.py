"""privcode: differentially private code LLMs on Ray and Kubernetes.

Stages (each importable on its own, each also a ``privcode`` subcommand):
data (private demo corpus), base (offline public base model), and the
pipeline runner that chains them on a Ray cluster and writes a report.
"""

__version__ = "0.1.0"
