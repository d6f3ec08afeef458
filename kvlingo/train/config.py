"""The training stage's config: one frozen dataclass, written into every checkpoint, translator and report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.settings import Refresh
from ..records.report import Metric

if TYPE_CHECKING:
    from ..inputs.models import PairConfig


def family_settings(family: str, flags: dict | None = None, geometry=None) -> dict:
    """A family's settings from option flags by dest (the rest: its defaults, which may need the pair's geometry)."""
    from ..core.families import FAMILIES

    return FAMILIES[family].settings_from(flags or {}, geometry, FAMILIES)


def resolve_family(profile, direction: str, family: str | None, flags: dict, geometry=None) -> tuple[str, dict]:
    """The family and its settings for a run: an explicit `family` takes its own defaults plus `flags` (the
    profile's variant belongs to the profile's family, not to a family named on the command line: `--family
    crosslayer --k 2` is full-rank even where the profile's default is a low-rank cross-layer map); without one,
    the profile's variant for the direction (`Profile.family`), with `flags` overriding its settings."""
    from ..core.families import variant

    if family is not None:
        return family, family_settings(family, flags, geometry)
    fam, v = variant(profile.family_for(direction))
    return fam.name, family_settings(fam.name, {**v.flags, **flags}, geometry)


# Settings that decide only when checkpoints are written, never the translator or a reported figure: a resume may
# change them, and the report records each stretch of updates with the value it ran under (results.segments).
# val_every is not among them: it decides where the validation curve was measured.
RESUME_SAFE = ("settings.checkpoint_every",)
DEFAULT_SEED = 42  # train_translator.py --seed when none is given


@dataclass(frozen=True)
class TrainConfig:
    profile: str  # run profile name (data budget, updates, batch)
    family: str  # translator family (kvlingo.core.families)
    family_settings: dict = field(default_factory=dict)  # the family's own settings (k, rank, base family ...)
    key_space: str = "prenorm"  # prenorm or cache: what the key maps read and write (kvlingo.core.keyspace)
    fit_weighting: str = (
        "uniform"  # uniform, or attention: context positions weighted by the target's reply-time attention
    )
    value_fit: str = "values"  # values, or output: the value maps fitted to the target's reply-time attention output
    ridge: float | str = "auto"  # ridge λ of the closed-form fit, or "auto": chosen per block on held-out conversations
    aux_attn_weight: float = 0.0  # weight of the attention-output MSE next to the KL (0: KL only)
    refresh: Refresh = Refresh()  # what the target recomputes under the translated cache in training (exact:0)
    context_weight: float = 0.0  # α: each reply token's KL weighted by the context's change of it (objectives.py)
    onpolicy: float = 0.0  # λ: share of conversations scored on replies the target samples from the translation
    keep_best: bool = False  # save the translator at the update with the lowest validation KL (early stopping)
    n_train: int = 0  # training conversations read: the first n of the train split (0: all of them)
    n_fit: int = 0  # train conversations in the closed-form fit (the first n_fit of a seeded order)
    updates: int = 0  # distillation optimiser updates
    batch: int = 1  # conversations accumulated per update (the adapter is batch-one)
    lr: float = 1e-4  # AdamW learning rate (at the first update)
    # the rate over the updates: constant, linear or cosine decay to 0 (distill.lr_at); the stage sets the profile's
    # (cosine), and a config written before the field existed read constant
    lr_schedule: str = "constant"
    weight_decay: float = (
        0.0  # AdamW decoupled weight decay; 0 so that the maps are not pulled toward zero, away from the fit
    )
    max_grad_norm: float = 1.0  # clip of the translator's gradient norm per update; 0 turns it off
    val_every: int = 1  # validation KL every N updates (and at the end)
    checkpoint_every: int = 1  # checkpoint every N updates (and at the end); a resume may change it (RESUME_SAFE)
    seed: int = DEFAULT_SEED  # data order and every RNG
    pair: PairConfig | None = None  # the resolved pair: models, direction, device, dtype, tokenizer digest

    def fit_settings(self) -> dict:
        """What the closed form depends on (besides data, code and the pair)."""
        return {
            "family": self.family,
            "family_settings": self.family_settings,
            "key_space": self.key_space,
            "fit_weighting": self.fit_weighting,
            "ridge": self.ridge,
            "n_fit": self.n_fit,
            "seed": self.seed,
            **({"n_train": self.n_train} if self.n_train else {}),
            **({"value_fit": self.value_fit} if self.value_fit != "values" else {}),
            # a choice of layers skips those the refresh makes the target's own, so it depends on the refresh
            **({"refresh": str(self.refresh)} if self.family_settings.get("token_choice", "first") != "first" else {}),
        }


@dataclass
class TrainResults:
    closed_form_val_kl: float  # validation KL of the closed-form translator (before any update)
    distilled_val_kl: float | None  # validation KL after the last update (None with --closed-form-only)
    loss_curve: list  # [{"update", "loss"}]: batch KL per update
    val_kl_curve: list  # [{"update", "val_kl", "se"}]: se over the validation conversations
    fit: dict | None  # closed-form fit statistics
    frozen_weights: dict  # fingerprints before/after of both frozen models
    resumed_from_update: int | None
    segments: list  # [{"from_update", "checkpoint_every", "world_size"}]: how each stretch of updates ran
    wall_time_s_total: float  # across resumed segments
    translator: dict  # family, parameter count, FLOPs per token
    artifacts: dict  # translator folders, their maps sha256, checkpoints, plot
    best: dict | None = None  # with keep_best: the update whose translator was saved, and its validation KL
    # each validation KL's SE over the validation conversations (n_samples.validation), as in val_kl_curve
    closed_form_val_kl_se: float | None = None
    distilled_val_kl_se: float | None = None

    METRICS = (
        Metric(
            "closed_form_val_kl",
            False,
            "mean over validation conversations of the mean reply-token "
            "KL(native target || target on the closed-form translated cache), nats",
        ),
        Metric("distilled_val_kl", False, "the same for the distilled translator"),
    )
