"""Run profiles: the budgets every stage reads. Data, not branches.

A profile fixes how much data each split holds, how long distillation runs, the token
caps and the evaluation sizes. Stages look a profile up by name with `get_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str  # profile name, also the folder under data/
    n_train: int  # training conversations (natural variant)
    n_validation: int  # validation conversations: learning-rate selection only
    n_test: int  # held-out test conversations: reported numbers only
    n_fit: int  # train conversations used by the closed-form fit
    updates: int  # distillation optimiser updates
    batch: int  # conversations accumulated per update (the adapter is batch-one)
    prefix_cap: int  # max prefix tokens; longer prefixes are cropped at a turn boundary
    reply_cap: int  # max reply tokens; longer replies are cropped
    ifeval_prompts: int  # IFEval prompts scored (541 is the full set)
    task_items: int  # ARC-Challenge / GSM8K items scored
    val_every: int  # validation KL every N updates
    checkpoint_every: int  # atomic checkpoint every N updates
    n_packed: int  # packed (long-context) examples per split
    timing_warmups: int  # untimed warm-up runs before each timed path
    timing_repeats: int  # timed trials per path
    max_new_tokens: int  # generation cap for IFEval / tasks
    lr_grid_size: int  # learning rates in the recipe's first grid (half-decade spaced)
    recipe_seeds: tuple[int, ...]  # seeds trained at the chosen learning rate


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            name="pilot", n_train=256, n_validation=64, n_test=64, n_fit=256, updates=100, batch=1,
            prefix_cap=1024, reply_cap=128, ifeval_prompts=32, task_items=64, val_every=25,
            checkpoint_every=100, n_packed=16, timing_warmups=5, timing_repeats=30,
            max_new_tokens=1024, lr_grid_size=5, recipe_seeds=(42, 43, 44),
        ),
        Profile(
            name="paper-budget", n_train=40_000, n_validation=64, n_test=64, n_fit=400, updates=5_000,
            batch=8, prefix_cap=16_384, reply_cap=2_048, ifeval_prompts=541, task_items=1_172,
            val_every=250, checkpoint_every=100, n_packed=64, timing_warmups=5, timing_repeats=30,
            max_new_tokens=1024, lr_grid_size=5, recipe_seeds=(42, 43, 44),
        ),
        # The offline toy world on a 2-core CPU: every stage runs for real, in minutes.
        Profile(
            name="demo", n_train=512, n_validation=32, n_test=48, n_fit=128, updates=400, batch=4,
            prefix_cap=384, reply_cap=48, ifeval_prompts=32, task_items=48, val_every=40,
            checkpoint_every=40, n_packed=8, timing_warmups=2, timing_repeats=8,
            max_new_tokens=48, lr_grid_size=3, recipe_seeds=(42, 43, 44),
        ),
        # Seconds, for the test suite's end-to-end pass.
        Profile(
            name="tiny", n_train=24, n_validation=6, n_test=6, n_fit=12, updates=4, batch=2,
            prefix_cap=96, reply_cap=16, ifeval_prompts=4, task_items=4, val_every=2,
            checkpoint_every=2, n_packed=2, timing_warmups=1, timing_repeats=3,
            max_new_tokens=12, lr_grid_size=2, recipe_seeds=(42, 43),
        ),
    ]
}


def get_profile(name: str, **overrides) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return replace(PROFILES[name], **overrides) if overrides else PROFILES[name]
