"""What a handoff reads besides the source's cache, as an export records it (`config["reads"]`): the token ids
it covers, and the target's tensors by checkpoint name with the sha256 of each as stored. A server loads and checks
only these (kvlingo/serve/contract.py); the export stage writes them (kvlingo/stages/export.py)."""

from __future__ import annotations

from typing import Any

from ..core.families import FAMILIES
from ..core.settings import Refresh
from .models import checkpoint_files, tensor_digests


def handoff_reads(family: str, refresh: str, target: dict[str, Any], key_space: str) -> dict[str, Any]:
    """What a handoff with these maps reads besides the source's cache: the token ids it covers, and the target's
    weights by checkpoint name with their sha256 (`models.tensor_digests` of `target_weight_names`), or all of
    them (a refresh that runs the target's own layers on part of the context). A server loads and checks only
    these."""
    from ..core import keyspace

    setting, features = Refresh.parse(refresh), FAMILIES[family].reads_layer0
    exact = setting.kind == "exact"
    reads: dict[str, Any] = {"source": "keys and values of every source layer", "token_ids": features or setting.active}
    if setting.active and not exact:
        reads["target_weights"] = "all"
    elif features or exact or keyspace.TARGET_WEIGHTS[key_space]:
        reads["target_weights"] = tensor_digests(
            checkpoint_files(target), lambda names: target_weight_names(names, family, setting, key_space)
        )
    else:
        reads["target_weights"] = {}
    return reads


def target_weight_names(names, family: str, refresh: Refresh, key_space: str) -> list[str]:
    """Of the target checkpoint's tensor `names`, those a handoff reads besides its token ids under `refresh` none
    or exact:0: the embedding, the first norm and layer 0's K/V projections (a family that reads the token
    features; exact:0 also layer 0's key norm), and the key norm of every layer (prenorm keys are finished with
    it). A refresh that runs the target's layers reads them all (`handoff_reads`)."""
    from ..core import keyspace, layer0

    exact = refresh.kind == "exact"
    picked = set(keyspace.read_weight_names(names, key_space))
    if FAMILIES[family].reads_layer0 or exact:
        picked.update(layer0.read_weight_names(names, exact))
    return sorted(picked)
