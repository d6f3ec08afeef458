"""The translator ablation: which levers carry a conversation's facts, at what cost.

Every setting trains on the same splits with the same distillation budget (the profile's): a
translator family and its flags, the refresh setting its cache is trained and evaluated under
(exact:0: the target's own layer 0 from the token ids), and the objective. The levers:

    the defaults before    crosshead (l2s), cross-layer k=4 at half rank (s2l)
    exact layer 0          exact:0 beside a family
    token identity         the tokeninput family: the target's layer-0 features of each token and
                           the two before it, beside the head-wise maps' input (low rank)
    objectives             context-weighted and on-policy distillation
    regularisation         weight decay and early stopping on validation

Deciding (choices on validation, claims on test). Every setting is scored on the validation
conversations (KL/token, the context metrics of kvlingo/eval/context.py, attention-output
agreement) and on the validation halves of IFEval and GSM8K (`Profile.ablate_items[0]` items
each). Across the settings, each candidate metric's rank correlation with task retention (the
mean of the IFEval and GSM8K shares of the native target's accuracy) says which one tracks the
tasks (where none does so significantly, exact p > `METRIC_P`, validation KL chooses). Among the
settings costing at most `MAX_COST_FRACTION` of a re-prefill at the real shapes,
the best by that metric is found, and the default is the cheapest setting within `TIE_SE` paired
standard errors of it, on that metric (per conversation) and on each validation task (per item):
a difference within noise is a tie, and a tie goes to the cheaper handoff. The chosen default and the direction's
default before are then scored on the test conversations and the test halves of the tasks
(`ablate_items[1]` items each): the claims.

Cost: each setting's FLOPs per context token at the real Qwen3-1.7B → 0.6B shapes (the
direction's source and target), against the target's re-prefill per token (`shapes.prefill_flops`,
dense): the translator's (with its rank scaled by the ratio of the real and toy target widths,
so that a rank of half the toy width stays half the real one; over the layers it translates),
plus the exact layer 0's one projection per token where the setting reads or writes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..eval.stats import ratio_influence

MAX_COST_FRACTION = 0.10  # the default's handoff FLOPs, at most this fraction of re-prefill at the real shapes
# Validation metrics whose rank correlation with task retention is measured, and whether higher is better.
METRICS = {
    "val_kl": False,
    "val_context_kl": False,
    "val_context_weighted_kl": False,
    "val_top1": True,
    "val_context_top1": True,
    "val_attention_cosine": True,
}
# Each metric from the benchmark's per-conversation sums of an arm (kvlingo/eval/quality.py): numerator and
# denominator summed over conversations, or (PER_CONVERSATION_MEAN) averaged per conversation.
METRIC_SUMS = {
    "val_kl": ("kl_sum", "n_tokens"),
    "val_context_kl": ("ctx_kl_sum", "ctx_n_tokens"),
    "val_context_weighted_kl": ("wkl_sum", "w_sum"),
    "val_top1": ("top1_sum", "n_tokens"),
    "val_context_top1": ("ctx_top1_sum", "ctx_n_tokens"),
    "val_attention_cosine": ("attn_cos_sum", "attn_n"),
}
PER_CONVERSATION_MEAN = {"val_attention_cosine"}
METRIC_P = 0.01  # a metric chooses only where its rank correlation with retention is this significant (exact p)
TIE_SE = 2.0  # a setting within this many paired SEs of the best (metric and each task) ties with it
TASK_NAMES = {"ifeval": "IFEval", "gsm8k": "GSM8K"}
# The objective rows: the profile's default translator trained with another objective (suffix, flags, note).
OBJECTIVES = (
    ("context", ("--context-weight", "0.5"), "each reply token's KL weighted by how much the context moves it (α 0.5)"),
    (
        "onpolicy",
        ("--onpolicy", "0.5"),
        "half the conversations scored on replies the target samples from the translation",
    ),
    (
        "reg",
        ("--weight-decay", "0.01", "--keep-best"),
        "weight decay 0.01 and the translator of the best validation KL",
    ),
)


@dataclass(frozen=True)
class Setting:
    """One row of the ablation: a family's variant (kvlingo/core/families), its option values at the pair's shapes,
    and the training flags beside them (an objective)."""

    name: str  # a short name: also the run folder under RUN/
    family: str  # translator family
    options: dict = field(default_factory=dict)  # the variant's option values by flag dest, at the pair's shapes
    option_flags: tuple[str, ...] = ()  # the same as train_translator.py flags
    train_flags: tuple[str, ...] = ()  # train_translator.py flags beside the family's (objectives, regularisation)
    note: str = ""  # what the setting tests
    refresh: str = "none"  # refresh setting of training and every evaluation (exact:0: the target's own layer 0)
    default_run: bool = True  # run by default (the others with --settings)

    @property
    def flags(self) -> tuple[str, ...]:
        """train_translator.py flags besides --family and --refresh."""
        return (*self.option_flags, *self.train_flags)


def _option_flags(cls, values: dict) -> tuple[str, ...]:
    """The training flags of option values by dest (a composite family's base options included)."""
    from ..inputs.flags import family_options

    by_dest = {o.dest: o.flag_name for owners in family_options().values() for _, o in owners}
    out: list[str] = []
    for dest, value in values.items():
        out += [by_dest[dest], str(value)]
    return tuple(out)


def _setting(cls, v, geometry, name: str | None = None, train_flags: tuple = (), note: str = "", default_run=None):
    values = {dest: (value(geometry) if callable(value) else value) for dest, value in v.flags.items()}
    return Setting(
        name or v.name,
        cls.name,
        values,
        _option_flags(cls, values),
        (*v.train_flags, *train_flags),
        note or v.note,
        v.refresh,
        v.default_run if default_run is None else default_run,
    )


def settings_for(profile, direction: str, geometry) -> tuple[Setting, ...]:
    """The rows of a direction: every family's variants, then the direction's default translator
    (`Profile.family_for`) trained with each objective of `OBJECTIVES`, at the pair's `geometry`."""
    from ..core.families import variant, variants

    rows = [_setting(cls, v, geometry) for cls, v in variants()]
    cls, default = variant(profile.family_for(direction))
    for suffix, flags, note in OBJECTIVES:
        rows.append(
            _setting(cls, default, geometry, f"{default.name}-{suffix}", flags, f"{default.name}, {note}", True)
        )
    return tuple(rows)


def before(profile, direction: str) -> str:
    """The direction's default before the ablation's choice (`Profile.baseline`): scored on test beside it."""
    return profile.baseline[0 if direction == "l2s" else 1]


def default_settings(profile, direction: str, geometry=None) -> list[str]:
    """The rows a run of this direction trains by default: every default one, the other direction's default before
    excepted (it answers another question and costs a row)."""
    other = {before(profile, d) for d in ("l2s", "s2l") if d != direction} - {before(profile, direction)}
    return [s.name for s in settings_for(profile, direction, geometry) if s.default_run and s.name not in other]


def real_cost(setting: Setting, direction: str, toy_geometry) -> dict[str, float]:
    """Handoff FLOPs per context token at the real shapes, as a fraction of the target's re-prefill."""
    import torch
    from transformers import Qwen3ForCausalLM

    from ..bench.shapes import prefill_flops, real_pair_configs, real_settings, translator_at
    from ..core import layer0
    from ..core.families import FAMILIES
    from ..core.settings import Refresh
    from ..train.config import family_settings

    src_cfg, tgt_cfg = real_pair_configs(direction)
    settings = family_settings(setting.family, setting.options, toy_geometry)
    toy_target_width = toy_geometry.target_width
    translator = translator_at(setting.family, settings, src_cfg, tgt_cfg, from_geometry=toy_geometry)
    with torch.device("meta"):
        target = Qwen3ForCausalLM(tgt_cfg)
    L = tgt_cfg.num_hidden_layers
    exact = setting.refresh == "exact:0"
    translate = translator.flops_per_token_without(Refresh.parse(setting.refresh).own_layers(L))
    own_layer0 = layer0.flops_per_token(tgt_cfg) if exact or FAMILIES[setting.family].reads_layer0 else 0.0
    flops, reprefill = translate + own_layer0, prefill_flops(target, 1)
    return {
        "translate_flops_per_token": translate,
        "layer0_flops_per_token": own_layer0,
        "handoff_flops_per_token": flops,
        "reprefill_flops_per_token": reprefill,
        "fraction_of_reprefill": flops / reprefill,
        "ceiling_speedup": reprefill / flops,
        "real_settings": real_settings(
            setting.family,
            settings,
            _width(tgt_cfg) / toy_target_width,
            depth_ratio=tgt_cfg.num_hidden_layers / toy_geometry.target_layers,
        ),
    }


def _width(cfg) -> int:
    return cfg.num_key_value_heads * cfg.head_dim


def retention(row: dict, split: str) -> float | None:
    """The mean of the IFEval and GSM8K shares of the native target's accuracy on `split`, or None."""
    kept = [row.get(f"{split}_{t}", {}).get("kept") for t in ("ifeval", "gsm8k")]
    kept = [k for k in kept if isinstance(k, (int, float)) and math.isfinite(k)]
    return sum(kept) / len(kept) if kept else None


def metric_correlations(rows: list[dict]) -> dict[str, dict]:
    """Each validation metric's Spearman correlation with validation retention across the settings, and its
    `tracking`: the correlation signed so that positive means the metric orders settings as retention does."""
    from ..eval.stats import spearman

    out = {}
    for name, higher_better in METRICS.items():
        pairs = [
            (r[name], retention(r, "val"))
            for r in rows
            if isinstance(r.get(name), (int, float)) and math.isfinite(r[name]) and retention(r, "val") is not None
        ]
        c = spearman([a for a, _ in pairs], [b for _, b in pairs])
        out[name] = {**c, "tracking": c["rho"] if higher_better else -c["rho"]}
    return out


def choose_metric(correlations: dict[str, dict]) -> str:
    """The validation metric that tracks retention best (highest signed correlation), where that correlation is
    positive and significant (exact p ≤ METRIC_P); else val KL, the distillation's own objective: a metric that
    does not track retention would choose on noise."""
    finite = {k: v["tracking"] for k, v in correlations.items() if math.isfinite(v["tracking"])}
    if not finite:
        return "val_kl"
    best = max(finite, key=lambda k: (finite[k], k == "val_kl"))
    p = correlations[best].get("p", float("nan"))
    return best if finite[best] > 0 and math.isfinite(p) and p <= METRIC_P else "val_kl"


def metric_per_conversation(arms: Sequence[dict], metric: str) -> tuple[float, list[float]]:
    """A validation metric from the benchmark's per-conversation sums of one arm, and each conversation's part of it
    (`ratio_influence` for a ratio of sums; the value itself for a per-conversation mean), in conversation order."""
    num, den = METRIC_SUMS[metric]
    if metric in PER_CONVERSATION_MEAN:
        xs = [a[num] / a[den] if a[den] else 0.0 for a in arms]
        return sum(xs) / len(xs), xs
    return ratio_influence([a[num] for a in arms], [a[den] for a in arms])


def seeds_of(row: dict) -> list[dict]:
    """A row's per-seed rows (`over_seeds`): the row itself where it was trained with one seed."""
    return row.get("seeds") or [row]


def with_seed_spread(se: float, per_seed: Sequence[float]) -> float:
    """The SE of a figure averaged over training seeds: the conversations' (or items') SE and the seeds' spread
    together, √(se² + var_seeds / N). Conservative: the conversation-by-seed part of the spread is in both terms.
    One seed: `se` itself."""
    from ..eval.stats import mean_se

    return se if len(per_seed) < 2 else math.hypot(se, mean_se(per_seed)["se"])  # mean_se's SE² is var / N


def _evidence(row: dict, metric: str) -> list[dict]:
    """A row's validation evidence per training seed: `val_evidence` (a list), else the row's own."""
    ev = row.get("val_evidence")
    if ev is not None:
        return ev
    return [{metric: row[metric], "val_conversations": row["val_conversations"], "val_items": row["val_items"]}]


def _seed_mean(xss: Sequence[Sequence[float]]) -> list[float]:
    return [sum(xs) / len(xs) for xs in zip(*xss)]


def within_noise(best: dict, other: dict, metric: str, tasks: Sequence[str]) -> dict[str, Any]:
    """Whether `other` is within TIE_SE standard errors of `best` on `metric` and on every validation task.

    Each row carries, per training seed (`val_evidence`: a list, the seeds in the same order in both rows; else the
    row itself for one seed), the metric's value, `val_conversations` ({"ids", metric: each conversation's part of
    it, `metric_per_conversation`}) and `val_items` ({task: {item key: correct}}): the validation evidence of
    `tie_evidence`. The comparison is one-sided (how much worse `other` is), conversation by conversation and item
    by item on the ones both rows hold, each averaged over the seeds; with several seeds the SE adds the spread of
    the per-seed differences (`with_seed_spread`), so a gap one training run opens by chance is not a verdict."""
    from ..eval.stats import paired_t

    higher = METRICS.get(metric, False)
    sign = 1.0 if higher else -1.0  # worse = lower for higher-is-better metrics
    ea, eb = _evidence(best, metric), _evidence(other, metric)
    if len(ea) != len(eb):
        raise ValueError(f"{best['name']} and {other['name']} were trained with different numbers of seeds")
    for a, b in zip(ea, eb):
        if a["val_conversations"]["ids"] != b["val_conversations"]["ids"]:
            raise ValueError(f"{best['name']} and {other['name']} were scored on different validation conversations")
    worse_s = [sign * (a[metric] - b[metric]) for a, b in zip(ea, eb)]  # ≥ 0 where other is worse
    parts_a = _seed_mean([a["val_conversations"][metric] for a in ea])
    parts_b = _seed_mean([b["val_conversations"][metric] for b in eb])
    se_conv = paired_t(parts_a, parts_b)["se"]  # of the two rows' parts, conversation by conversation
    worse, se = sum(worse_s) / len(worse_s), with_seed_spread(se_conv, worse_s)
    spread = {"seeds": len(ea), "se_conversations": se_conv} if len(ea) > 1 else {}
    out: dict[str, Any] = {"metric": {"worse_by": worse, "se": se, "tied": worse <= TIE_SE * se, **spread}}
    for t in tasks:
        ia, ib = [a["val_items"][t] for a in ea], [b["val_items"][t] for b in eb]
        keys = sorted(set.intersection(*(set(x) for x in ia + ib)))
        d = paired_t(
            _seed_mean([[float(x[k]) for k in keys] for x in ia]),
            _seed_mean([[float(x[k]) for k in keys] for x in ib]),
        )
        per_seed = [sum(float(x[k]) - float(y[k]) for k in keys) / max(1, len(keys)) for x, y in zip(ia, ib)]
        se_t = with_seed_spread(d["se"], per_seed)
        out[t] = {
            "worse_by_points": 100 * d["mean_diff"],
            "se_points": 100 * se_t,
            "n": len(keys),
            "tied": d["mean_diff"] <= TIE_SE * se_t,
        }
    out["tied"] = all(v["tied"] for v in out.values() if isinstance(v, dict))
    return out


def choose_default(rows: list[dict], metric: str = "val_kl", tasks: Sequence[str] | None = None) -> dict[str, Any]:
    """The admissible setting (cost ≤ MAX_COST_FRACTION) best by `metric` on validation; ties to the cheaper.

    With `tasks` (rows carrying `tie_evidence`): the cheapest admissible setting within TIE_SE paired SEs of the
    best on `metric` and on each of those validation tasks (`within_noise`): a difference within noise is a tie,
    and a tie goes to the cheaper handoff."""
    higher = METRICS.get(metric, False)
    ok = [
        r
        for r in rows
        if r["real"]["fraction_of_reprefill"] <= MAX_COST_FRACTION
        and isinstance(r.get(metric), (int, float))
        and math.isfinite(r[metric])
    ]
    if not ok:
        return {
            "setting": None,
            "metric": metric,
            "why": f"no setting costs at most {MAX_COST_FRACTION:.0%} of re-prefill with a finite {metric}",
        }
    ranked = sorted(ok, key=lambda r: ((-1 if higher else 1) * r[metric], r["real"]["fraction_of_reprefill"]))
    best = ranked[0]
    out = {
        "setting": best["name"],
        "metric": metric,
        "value": best[metric],
        "runner_up": ranked[1]["name"] if len(ranked) > 1 else None,
        "fraction_of_reprefill": best["real"]["fraction_of_reprefill"],
        "why": f"best {metric} on validation among the {len(ok)} settings costing ≤ {MAX_COST_FRACTION:.0%} of "
        "re-prefill at the real shapes (the test split and test items take no part)",
    }
    if tasks is None:
        return out
    ties = {r["name"]: within_noise(best, r, metric, tasks) for r in ranked}
    tied = [r for r in ranked if ties[r["name"]]["tied"]]
    pick = min(tied, key=lambda r: r["real"]["fraction_of_reprefill"])  # the best itself is always tied
    names = ", ".join(r["name"] for r in tied)
    return {
        **out,
        "setting": pick["name"],
        "value": pick[metric],
        "best": best["name"],
        "fraction_of_reprefill": pick["real"]["fraction_of_reprefill"],
        "ties": ties,
        "why": f"the cheapest of the settings within {TIE_SE:g} paired SE of the best {metric} on validation "
        f"({best['name']}) and of its validation {' and '.join(TASK_NAMES.get(t, t) for t in tasks)} accuracy "
        f"({names}), among the {len(ok)} costing ≤ {MAX_COST_FRACTION:.0%} of re-prefill at the real shapes "
        "(the test split and test items take no part)",
    }


def kept(translated: dict, native: dict, comparison: dict) -> dict[str, float]:
    """Translated accuracy as a share of the native target's on the same items, with a delta-method SE that
    uses the pairing (from McNemar's discordant counts), and the paired difference in points ± SE."""
    n = translated["n"]
    a, b = translated["mean"], native["mean"]
    only_a, only_b = comparison["mcnemar"]["a_only"], comparison["mcnemar"]["b_only"]
    d_mean = (only_a - only_b) / n
    d_var = ((only_a + only_b) / n - d_mean**2) * n / max(1, n - 1)
    both = a - only_a / n  # right on both paths
    cov = (both - a * b) * n / max(1, n - 1)
    va, vb = a * (1 - a) * n / max(1, n - 1), b * (1 - b) * n / max(1, n - 1)
    ratio = a / b if b else float("nan")
    se = ratio * math.sqrt(max(0.0, va / a**2 + vb / b**2 - 2 * cov / (a * b)) / n) if a and b else float("nan")
    return {
        "kept": ratio,
        "kept_se": se,
        "delta_points": 100 * d_mean,
        "delta_se_points": 100 * math.sqrt(d_var / n),
        "mcnemar_p": comparison["mcnemar"]["p"],
        "n": n,
        "accuracy": a,
        "accuracy_se": translated["se"],
        "native": b,
        "native_se": native["se"],
    }


# A row's figures that depend on its training seed (the rest, its setting and cost, are the same for every seed), and
# the (value, SE) fields of a figure held as a dict (a task's share kept, a per-conversation mean).
SEEDED = ("val_", "test_", "closed_form_val_kl", "distilled_val_kl", "train_wall_s", "best_update")
SE_FIELDS = (
    ("mean", "se"),
    ("accuracy", "accuracy_se"),
    ("kept", "kept_se"),
    ("delta_points", "delta_se_points"),
    ("native", "native_se"),
)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _over_seeds(xs: list) -> Any:
    """One field over the seeds: numbers the mean (unchanged where the seeds agree: a count), else a list per seed."""
    if all(_number(x) for x in xs):
        return xs[0] if all(x == xs[0] for x in xs) else sum(xs) / len(xs)
    return xs


def _figure_over_seeds(figs: Sequence[dict]) -> dict:
    """One figure dict from each seed's: every number the mean over the seeds (unchanged where they agree), each SE
    with the seeds' spread (`with_seed_spread`, from the RMS of the seeds' SEs), other fields as a list per seed
    (a McNemar p of each seed's answers)."""
    out: dict[str, Any] = {f: _over_seeds([d.get(f) for d in figs]) for f in figs[0]}
    for value, se in SE_FIELDS:
        if value in out and se in out and all(_number(d[value]) and _number(d[se]) for d in figs):
            rms = math.sqrt(sum(d[se] ** 2 for d in figs) / len(figs))
            out[se] = with_seed_spread(rms, [d[value] for d in figs])
    if "mcnemar_p" in out:
        out["mcnemar_p"] = [d.get("mcnemar_p") for d in figs]  # per seed: a mean of p-values is not a p-value
    out["seeds"] = len(figs)
    return out


def seed_means(rows: Sequence[dict], prefix: tuple[str, ...] | str = SEEDED) -> dict:
    """The seeded figures (keys starting with `prefix`) of one setting's per-seed rows, over the seeds: figure dicts by
    `_figure_over_seeds`, other fields by `_over_seeds`."""
    out: dict[str, Any] = {}
    for k in rows[0]:
        if k.startswith(prefix) and all(k in r for r in rows):
            xs = [r[k] for r in rows]
            out[k] = _figure_over_seeds(xs) if all(isinstance(x, dict) for x in xs) else _over_seeds(xs)
    return out


def over_seeds(rows: Sequence[dict], name: str) -> dict:
    """One setting trained with each of several seeds (one row each, in the seeds' order, its folder under "run") as
    one row named `name`: its seeded figures over the seeds (`seed_means`), each seed's own row under "seeds". One
    seed: that row, named `name`."""
    if len(rows) == 1:
        return {**rows[0], "name": name}
    shared = {k: v for k, v in rows[0].items() if not k.startswith(SEEDED) and k not in ("seed", "run")}
    return {**shared, "name": name, **seed_means(rows), "seeds": list(rows)}
