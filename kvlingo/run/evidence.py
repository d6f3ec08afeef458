"""A translator's evidence (what its run measured) and the gate that decides whether it may be used.

The evidence is taken from a run's reports, never typed in: the benchmark's acceptance arms on
the held-out test split (native target, translated = the exported maps, control, no-context;
each with n, token-level KL, per-conversation KL ± SE, top-1 agreement and NLL Δ against the
native target), whether its native controls passed, and IFEval's strict prompt-level accuracy
± SE per answering path when the run has an IFEval report for the same maps.

The gate reads the figures, not a stored verdict, so a loader judges every folder by its own
thresholds (`Gate`); `judge` names each failing figure.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..core.translator import TranslatorError

EVIDENCE_VERSION = 1
# Evidence arm → the benchmark arm it is read from ("translated" is the exported translator's own arm).
ARMS = ("native_target", "translated", "control", "no_context")
IFEVAL_METRIC = "prompt_level_strict_acc"


class EvidenceError(TranslatorError):
    """Reports that cannot vouch for a translator (they scored other maps or another pair, or lack an arm)."""


@dataclass(frozen=True)
class Gate:
    """What a translator must have shown on its benchmark before it is used without `allow_unproven`."""

    # Top-1 agreement with the native target over reply tokens: below 0.80, more than one reply token in
    # five would be decoded differently from the target reading its own cache.
    min_top1: float = 0.80
    # Reply NLL minus the native target's, nats per token: 0.25 nats is a reply perplexity 1.28× the native one.
    max_nll_delta: float = 0.25
    # The translated arm's KL per token must be below the control's (the same maps on another conversation's
    # cache): otherwise the maps' output does not depend on the conversation they read.
    beat_control: bool = True
    # The benchmark's native controls (injection equals split execution) must have passed: otherwise no
    # figure of that run can be trusted.
    native_controls: bool = True


@dataclass(frozen=True)
class Verdict:
    passed: bool
    failures: tuple[str, ...]  # each failing check with its figure and threshold, in words
    gate: Gate

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "failures": list(self.failures), "thresholds": asdict(self.gate)}


# --------------------------------------------------------------------------- from reports
def collect(benchmark: dict[str, Any], kind: str, ifeval: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evidence for the `kind` translator of a run (closed_form or distilled) from its benchmark report
    and, when given, its translated IFEval report."""
    arms = benchmark["results"]["quality"]["arms"]
    source = {"native_target": "native_target", "translated": kind, "control": "control", "no_context": "no_context"}
    missing = [name for name, arm in source.items() if arm not in arms]
    if missing:
        raise EvidenceError(f"the benchmark report has no {', '.join(source[m] for m in missing)} arm; "
                            f"run `make benchmark` with the {kind} translator present")
    control_of = benchmark["results"]["quality"].get("control_translator")
    if control_of != kind:
        raise EvidenceError(f"the benchmark's control arm used the {control_of} translator, not {kind}, so it says "
                            f"nothing about these maps; export the {control_of} maps, or benchmark the {kind} maps alone")
    paired = benchmark["results"]["quality"].get("paired", {})
    env = benchmark["env"]
    evidence = {
        "evidence_version": EVIDENCE_VERSION,
        "translator": kind,
        # The part of each translated context the target recomputed (kvlingo/core/refresh.py): the figures
        # hold for the maps used with this setting, so a relay hands over with it too.
        "refresh": benchmark["config"].get("refresh", "none"),
        "benchmark": {
            "split": benchmark["config"].get("variant", "natural"),
            "test_split_sha256": benchmark["inputs"]["test_split"]["sha256"],
            "n_conversations": benchmark["n_samples"]["conversations"],
            "n_reply_tokens": benchmark["n_samples"]["reply_tokens"],
            "dtype": env.get("dtype"), "device": env.get("device"),
            "git_sha": env.get("git_sha"), "git_dirty": env.get("git_dirty"),
            "torch": env.get("torch"), "transformers": env.get("transformers"),
            "native_controls_passed": benchmark["results"]["checks"]["controls_passed"],
        },
        "arms": {name: arms[arm] for name, arm in source.items()},
        # Paired t-tests over conversations on per-conversation mean reply NLL (a − b).
        "paired": {name.replace(kind, "translated"): test for name, test in paired.items()
                   if name.startswith(f"{kind}_vs_")},
        "ifeval": ifeval_evidence(ifeval) if ifeval is not None else None,
    }
    if ifeval is not None and ifeval["config"].get("refresh", "none") != evidence["refresh"]:
        raise EvidenceError(f"IFEval ran with refresh {ifeval['config'].get('refresh', 'none')}, the benchmark with "
                            f"{evidence['refresh']}; run both with the same --refresh")
    return evidence


def ifeval_evidence(report: dict[str, Any]) -> dict[str, Any]:
    """Strict prompt-level accuracy (mean ± SE, n) per answering path of a translated IFEval report."""
    cfg = report["config"]
    return {
        "metric": IFEVAL_METRIC,
        "paths": {path: s[IFEVAL_METRIC] for path, s in report["results"]["paths"].items()},
        "hit_cap": {path: s.get("hit_cap") for path, s in report["results"]["paths"].items()},
        "max_new_tokens": cfg["max_new_tokens"],
        "enable_thinking": cfg["enable_thinking"],
        "n_prompts": report["n_samples"]["prompts"],
    }


# --------------------------------------------------------------------------- the gate
def judge(evidence: dict[str, Any] | None, gate: Gate = Gate()) -> Verdict:
    """The gate's verdict on the figures of `evidence` (None: no evidence at all). A figure that is missing,
    not a number or not finite (NaN) fails its check, named as such: nothing passes by a comparison with NaN."""
    if evidence is None:
        return Verdict(False, ("no evidence: the folder holds no benchmark figures",), gate)
    failures = []

    def at(*keys: str) -> Any:
        node: Any = evidence
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        return node

    def figure(*keys: str) -> float | None:
        node = at(*keys)
        if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
            failures.append(f"evidence {'.'.join(keys)} is {node!r}, not a finite number")
            return None
        return float(node)

    convs, tokens = at("arms", "translated", "n_conversations"), at("arms", "translated", "n_tokens")
    n = f"(n={convs} conversations, {tokens} reply tokens)"
    top1 = figure("arms", "translated", "top1_agreement")
    if top1 is not None and top1 < gate.min_top1:
        failures.append(f"top-1 agreement with the native target {top1:.3f} < {gate.min_top1:.2f} {n}")
    nll = figure("arms", "translated", "nll_delta_vs_native_target")
    if nll is not None and nll > gate.max_nll_delta:
        failures.append(f"NLL Δ vs the native target {nll:.3f} nats/token > {gate.max_nll_delta:.2f} {n}")
    if gate.beat_control:
        t, c = figure("arms", "translated", "kl_token_mean"), figure("arms", "control", "kl_token_mean")
        if t is not None and c is not None and not t < c:
            failures.append(f"translated KL {t:.3f} nats/token does not beat the control's {c:.3f}")
    if gate.native_controls:
        passed = at("benchmark", "native_controls_passed")
        if passed is not True:
            failures.append("the benchmark's native controls failed (its injection path was not exact)" if passed is False
                            else f"evidence benchmark.native_controls_passed is {passed!r}, not true or false")
    return Verdict(not failures, tuple(failures), gate)
