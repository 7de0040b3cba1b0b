"""PrivLC, PrivCode++'s latent-conditioning module: encoders E_c, E_p and the prefix decoder D.
Design notes: docs/methods.md, "train/privlc.py".

Shapes (H: the junior's hidden size, dz: ``latent_dim``, K: ``num_virtual_tokens``,
W: ``encoder_hidden`` or H): ``E_c``: ``h_c`` [B, H] -> MLP (H -> W -> W, GELU) -> heads
``mu``, ``log sigma^2`` [B, dz]; ``z_c = mu + sigma * eps``, ``eps ~ N(0, I)``. ``E_p``:
``h_p`` [B, H] -> MLP (H -> W -> dz) = ``z_p``. ``D``: ``nn.Linear(dz, K * H)`` -> [B, K, H]
virtual-token embeddings prepended to the code's token embeddings.

Per-record losses: ``L_VAE = 1/2 sum_d (mu_d^2 + sigma_d^2 - log sigma_d^2 - 1)``;
``L_align`` with ``s(a, b) = cos(a, b) / tau``, InfoNCE against PUBLIC prompts' latents
``{z_b}`` (current E_p, no gradient): ``-s(mu, z_p) + log(exp s(mu, z_p) + sum_b exp s(mu, z_b))``,
or ``1 - cos(mu, z_p)`` with no negatives. Negatives never come from the batch: each record's
loss depends on its own record only (DP-SGD's sensitivity ``C``). Built from ``nn.Linear`` and
parameter-free activations (Opacus' per-sample gradients). ``D`` is released with the adapter;
``E_c`` and ``E_p`` have seen private data and are never released.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["CodeEncoder", "PromptEncoder", "align_loss", "make_prefix_decoder", "vae_kl"]


class CodeEncoder(nn.Module):
    """E_c: ``h_c -> (mu, log sigma^2)``."""

    def __init__(self, hidden: int, width: int, latent_dim: int):
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, width), nn.GELU()
        )
        self.mu = nn.Linear(width, latent_dim)
        self.logvar = nn.Linear(width, latent_dim)
        # Start near the prior (sigma = 1 before training); small heads keep
        # the first steps' L_VAE gradients modest.
        nn.init.normal_(self.logvar.weight, std=1e-3)
        nn.init.zeros_(self.logvar.bias)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.trunk(h)
        return self.mu(t), self.logvar(t).clamp(-10.0, 10.0)


class PromptEncoder(nn.Module):
    """E_p: ``h_p -> z_p``."""

    def __init__(self, hidden: int, width: int, latent_dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, latent_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


def make_prefix_decoder(
    latent_dim: int, num_virtual_tokens: int, hidden: int, embedding_std: float
) -> nn.Linear:
    """D as a plain ``nn.Linear(dz, K * H)`` (Opacus matches layers by exact type).

    Initialised so that for ``z ~ N(0, I)`` the prefix entries have about the
    standard deviation of the model's token embeddings: virtual tokens start
    on the scale of real ones.
    """
    decoder = nn.Linear(latent_dim, num_virtual_tokens * hidden)
    nn.init.normal_(decoder.weight, std=embedding_std / math.sqrt(latent_dim))
    nn.init.zeros_(decoder.bias)
    return decoder


def vae_kl(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, diag exp(logvar)) || N(0, I)) per row: [B, dz] -> [B]."""
    return 0.5 * (mu.pow(2) + logvar.exp() - logvar - 1.0).sum(dim=-1)


def align_loss(
    z_code: torch.Tensor, z_prompt: torch.Tensor, negatives: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """Per-row alignment loss of ``z_code[i]`` with ``z_prompt[i]`` (see the module docstring).

    ``negatives`` [M, dz] must be public (treated as constants); ``None``
    selects the no-negative form. Row i uses row i of each input only.
    """
    a = nn.functional.normalize(z_code.float(), dim=-1)
    b = nn.functional.normalize(z_prompt.float(), dim=-1)
    pos = (a * b).sum(dim=-1)
    if negatives is None:
        return 1.0 - pos
    n = nn.functional.normalize(negatives.detach().float(), dim=-1)
    logits = torch.cat([pos[:, None], a @ n.T], dim=1) / temperature
    return torch.logsumexp(logits, dim=1) - logits[:, 0]
