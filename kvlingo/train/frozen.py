"""The frozen models stay frozen: no trainable parameter, and the same weight bytes before and after."""

from __future__ import annotations

from typing import Any

from ..errors import Failure
from ..inputs.models import weights_fingerprint


class FrozenWeightsChanged(Failure, RuntimeError):
    """A frozen model's weights changed during training."""


def check_frozen(models: dict[str, Any]) -> None:
    for name, model in models.items():
        live = [n for n, p in model.named_parameters() if p.requires_grad]
        if live:
            raise FrozenWeightsChanged(f"the {name} model has trainable parameters ({live[:3]}...); it must be frozen")


def fingerprints(models: dict[str, Any]) -> dict[str, str]:
    return {name: weights_fingerprint(m) for name, m in models.items()}


def verify_frozen(models: dict[str, Any], before: dict[str, str]) -> dict[str, Any]:
    """Fingerprints after training against `before`; raises FrozenWeightsChanged on any difference."""
    check_frozen(models)
    after = fingerprints(models)
    report = {
        name: {"before": before[name], "after": after[name], "match": before[name] == after[name]} for name in before
    }
    changed = [f"{n} {r['before'][:12]}… → {r['after'][:12]}…" for n, r in report.items() if not r["match"]]
    if changed:
        raise FrozenWeightsChanged("frozen model weights changed during training: " + "; ".join(changed))
    return {"requires_grad_off": True, "models": report, "verified": True}
