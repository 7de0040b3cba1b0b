"""Train the m worlds of PAC-private generation: one LoRA adapter per world, no DP.

NOT PRIVATE ON ITS OWN: the worlds are fine-tuned on the private corpus without differential
privacy; only the PAC curator's noisy release (:mod:`privcode.pac.curator`) protects them. The
artifact stays inside the private boundary: only the serving process reads it.

:func:`privcode.pac.mechanism.assign_worlds` puts every record in exactly ``m/2`` worlds
(membership prior 1/2); world ``s`` is a LoRA adapter over the frozen public base, trained on
its members with the mean token cross-entropy of ``prompt ++ code``. All worlds train at once:
a step runs ONE forward over ``m * B`` rows (``B = pac.batch_size`` members of every world),
loss ``sum_s (1/B) sum_{i in batch_s} loss_i``; adapter ``s`` gets gradient from its own rows
only and AdamW is elementwise, so this is exactly ``m`` independent trainings. A world's
initialisation and batches are seeded by ``(pac.seed, s)`` alone, whatever
``pac.world_groups``; the worlds' weights, gradients and AdamW state stay float32.
Artifact (``out_dir``): ``pac.json`` (format, m, base_model, worlds in world order, lora,
training settings, NOT_PRIVATE), ``adapters/<name>/``, ``assignment.npy`` ([records, m]
membership; private: audits only). Design notes: docs/serving.md, "privcode/pac/worlds.py".
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from peft import get_peft_model
from tqdm.auto import tqdm

from privcode.artifacts.pac import WORLDS_FORMAT, PacWorldsRecord
from privcode.config import PacConfig
from privcode.data.records import read_records
from privcode.dp.engine import Privacy, make_private
from privcode.errors import PrivcodeError
from privcode.models.chat import CHAT_TEMPLATE
from privcode.models.encoding import collate, encode_records, token_ce
from privcode.models.loading import load_causal_lm, load_tokenizer, lora_config
from privcode.models.placement import gpu_options, placement
from privcode.pac.mechanism import assign_worlds
from privcode.privacy.identities import tokenizer_id

log = logging.getLogger("privcode.pac")

__all__ = [
    "FORMAT",
    "MANIFEST",
    "NOT_PRIVATE_NOTE",
    "WorldsError",
    "group_task_options",
    "train_worlds",
    "world_names",
]

FORMAT = WORLDS_FORMAT
MANIFEST = PacWorldsRecord.FILE
NOT_PRIVATE_NOTE = (
    "m LoRA worlds fine-tuned WITHOUT differential privacy on the private "
    "corpus: serve them only through the PAC curator; never copy them out of "
    "the private boundary"
)
#: Why the worlds train without DP, as the DP engine records it (pac.json ``training_mode``).
REASON = "pac worlds: protected by the PAC curator's noisy release at serving, not by DP-SGD"


class WorldsError(PrivcodeError, ValueError):
    """The worlds cannot be trained: bad corpus or settings."""


def world_names(m: int) -> list[str]:
    width = max(3, len(str(m - 1)))
    return [f"w{s:0{width}d}" for s in range(m)]


def _sample_batches(
    members: list[np.ndarray], batch: int, rngs: list[np.random.Generator]
) -> list[np.ndarray]:
    """``batch`` distinct members of every world (all of them when a world is smaller)."""
    return [
        rng.choice(idx, size=min(batch, idx.size), replace=False)
        for idx, rng in zip(members, rngs, strict=True)
    ]


def _world_seed(seed: int, s: int) -> list[int]:
    # Per world, so a world's init and batches do not depend on how worlds are grouped.
    return [int(seed), int(s)]


def _torch_seed(seed: int, s: int) -> int:
    return int(np.random.SeedSequence(_world_seed(seed, s)).generate_state(1)[0])


def _row_losses(model: Any, rows: dict[str, Any], names: list[str]) -> Any:
    """Mean next-token cross-entropy of each row (padding excluded), through its adapter."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask, adapter_names=names).logits[:, :-1]
    tmask = mask[:, 1:].float()
    return (token_ce(logits, ids[:, 1:]) * tmask).sum(1) / tmask.sum(1).clamp_min(1.0)


def _train_group(
    cfg: PacConfig,
    base: str,
    encoded: list[Any],
    pad_id: int,
    assignment: np.ndarray,
    worlds: list[int],
    out_dir: str,
    progress: bool,
) -> dict[str, Any]:
    """Train the adapters of ``worlds`` (world indices) and save them under ``out_dir``."""
    started = time.time()
    where = placement(cfg.use_gpu, cfg.dtype, "pac.use_gpu")
    device = where.device
    lm = load_causal_lm(base, dtype=where.dtype, device=device)
    names = world_names(cfg.worlds)
    lora = lora_config(lm, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=0.0)
    torch.manual_seed(_torch_seed(cfg.seed, worlds[0]))
    model = get_peft_model(lm, lora, adapter_name=names[worlds[0]])
    for s in worlds[1:]:
        torch.manual_seed(_torch_seed(cfg.seed, s))
        model.add_adapter(names[s], lora)
    # add_adapter leaves only the active adapter trainable: every world's is.
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    params = [p for p in model.parameters() if p.requires_grad]
    if any(p.dtype != torch.float32 for p in params):  # peft's autocast_adapter_dtype
        raise WorldsError(
            f"the worlds' LoRA weights are {sorted({str(p.dtype) for p in params})} over a "
            f"{where.dtype} base: they must train in float32"
        )
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    members = [np.flatnonzero(assignment[:, s]) for s in worlds]
    if min(len(x) for x in members) == 0:
        raise WorldsError("a world has no member records: the corpus is too small")
    rngs = [np.random.default_rng(_world_seed(cfg.seed, s)) for s in worlds]
    # The rows a step can draw: (world, record) pairs; a step takes B members of every world.
    pairs = [(s, int(i)) for s, idx in zip(worlds, members, strict=True) for i in idx]
    starts = np.cumsum([0] + [len(x) for x in members])

    def sample(step: int) -> list[int]:
        chosen = _sample_batches([np.arange(len(x)) for x in members], cfg.batch_size, rngs)
        return [int(starts[k] + j) for k, c in enumerate(chosen) for j in c]

    def rows_of(local: list[int], step: int) -> dict[str, Any]:
        picked = [pairs[j] for j in local]
        rows = collate([encoded[i] for _, i in picked], pad_id, device=device)
        per_world = {s: sum(1 for t, _ in picked if t == s) for s in worlds}
        rows["adapter_names"] = [names[s] for s, _ in picked]
        rows["sizes"] = torch.tensor(
            [per_world[s] for s, _ in picked], dtype=torch.float32, device=device
        )
        return rows

    def loss_fn(module: Any, rows: dict[str, Any]) -> Any:
        return _row_losses(module, rows, rows["adapter_names"]) / rows["sizes"]

    model.eval()  # mixed-adapter batches need eval mode; see the module docstring
    # The DP engine's non-private mode: sum_s (1/B_s) sum_{i in batch_s} loss_i, no noise.
    engine = make_private(
        model,
        optimizer,
        Privacy.non_private(REASON),
        num_records=len(pairs),
        sample_rate=1.0,
        sampler=sample,
        expected_batch_size=1.0,
        train_mode=False,
        device=device,
        # bf16 matmuls on CUDA; on the CPU peft runs the fp32 adapters on upcast inputs.
        autocast_dtype=where.dtype if where.cuda else None,
    )
    for step in tqdm(
        range(cfg.steps),
        desc=f"pac worlds {worlds[0]}..{worlds[-1]}",
        mininterval=10.0,
        disable=not progress,
    ):
        engine.step(step, rows_of, loss_fn)
    out = Path(out_dir) / "adapters"
    for s in worlds:
        tmp = out / f".tmp-{names[s]}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out / names[s], ignore_errors=True)
        model.save_pretrained(str(tmp), selected_adapters=[names[s]])
        # peft writes a non-default adapter under <dir>/<name>/.
        (tmp / names[s] if (tmp / names[s]).is_dir() else tmp).rename(out / names[s])
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "worlds": len(worlds),
        "seconds": round(time.time() - started, 1),
        "device": str(device),
    }


def group_task_options(cfg: PacConfig) -> dict[str, Any]:
    """Ray options of one world-group task: 1 CPU, and 1 GPU with ``pac.use_gpu``."""
    return {"num_cpus": 1, **gpu_options(1.0 if cfg.use_gpu else 0.0)}


def train_worlds(
    cfg: PacConfig,
    *,
    data: str | Path,
    base: str | Path,
    out_dir: str | Path,
    progress: bool = True,
    dataset_id: str | None = None,
    store: Any = None,
) -> dict[str, Any]:
    """Train ``cfg.worlds`` adapters on ``data`` (private records) into ``out_dir``.

    ``dataset_id`` (the data's opaque id in the privacy store) goes into ``pac.json``. With
    ``store`` (a :class:`~privcode.privacy.store.PrivacyStore`) it is the records' id, and the
    records (their keyed identities) are logged in the store's ledger first
    (:func:`~privcode.privacy.admission.register_pac_data`): every set of worlds trained on any
    of them, from this file or a copy, reformat or overlap of it, is then held to each record's
    PAC budget. Returns the public summary (settings, sizes, timings: nothing about a record).
    The adapters are NOT private on their own (see the module docstring).
    """
    msg = (
        f"pac: training {cfg.worlds} worlds WITHOUT DP on the private corpus (NOT PRIVATE "
        "on their own: only the PAC curator's release is private)"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    log.warning(msg)
    started = time.time()
    out = Path(out_dir)
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(base))
    records = read_records(data)
    if len(records) < 2:
        raise WorldsError(f"pac: {len(records)} private records; the worlds need at least 2")
    encoded = encode_records(records, tokenizer, cfg.max_length)
    if store is not None:  # the records' PAC accounts, before anything trains on them
        from privcode.privacy.admission import register_pac_data

        dataset_id = register_pac_data(store, records, encoded, tokenizer_id(tokenizer))
    del records
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    assignment = assign_worlds(len(encoded), cfg.worlds, cfg.seed)
    np.save(out / "assignment.npy", assignment)
    groups = [list(g) for g in np.array_split(np.arange(cfg.worlds), cfg.world_groups)]
    if len(groups) == 1:
        results = [
            _train_group(cfg, str(base), encoded, pad, assignment, groups[0], str(out), progress)
        ]
    else:
        task = ray.remote(_train_group).options(**group_task_options(cfg))
        enc_ref, asg_ref = ray.put(encoded), ray.put(assignment)
        results = ray.get(
            [
                task.remote(cfg, str(base), enc_ref, pad, asg_ref, g, str(out), progress)
                for g in groups
            ]
        )
    summary = {
        "m": cfg.worlds,
        "records": len(encoded),
        "steps": cfg.steps,
        "batch_size_per_world": cfg.batch_size,
        "lr": cfg.lr,
        "max_length": cfg.max_length,
        "lora": {"r": cfg.lora_r, "alpha": cfg.lora_alpha},
        "groups": [{k: r[k] for k in ("worlds", "seconds", "device")} for r in results],
        "seconds": round(time.time() - started, 1),
    }
    PacWorldsRecord(
        format=FORMAT,
        m=cfg.worlds,
        worlds=tuple(world_names(cfg.worlds)),
        base_model=str(Path(base).resolve()),
        lora=summary["lora"],
        not_private=NOT_PRIVATE_NOTE,
        training_mode=Privacy.non_private(REASON).record(),
        seed=cfg.seed,
        records=summary["records"],
        steps=cfg.steps,
        batch_size_per_world=cfg.batch_size,
        lr=cfg.lr,
        max_length=cfg.max_length,
        groups=summary["groups"],
        seconds=summary["seconds"],
        dataset_id=dataset_id,
        chat_template=CHAT_TEMPLATE,
    ).write(out / MANIFEST)
    return summary
