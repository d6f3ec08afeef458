"""`KvlingoConnector`: a vLLM v1 KV connector that starts a request from another model's translated cache.

    from kvlingo.serve.connector import engine_args
    llm = LLM(model="artifacts/toy/small", **engine_args(export="artifacts/run-l2s/export"))

Each engine gets one; the connector both saves what its engine computes (into the process's
`store.STORE`, for the other engine to translate) and loads:

- scheduler side (`get_num_new_matched_tokens`): the longest source cache in the store that
  shares a prefix with the prompt, admitted by the contract (`contract.Contract`), gives the
  tokens the translation fills: never the prompt's last token (as in `kvlingo.Relay`; whole
  blocks only with `whole_blocks`), less the refresh's
  tail, which the engine prefills itself on top. Where the store also holds this model's own
  cache of a prefix of the prompt (an earlier turn it served), that prefix is reused as it is
  and only the rest is translated: each part of a conversation that switches back and forth is
  then translated once, from the model that computed it. Anything refused is logged with its reason
  and the request is prefilled as usual (0 matched tokens).
- worker side (`start_load_kv`): translates those tokens with the prompt's token ids they cover
  (`Contract.translate`: maps that read the target's token features, and the exact:0 refresh,
  compute the target's layer 0 from them) and writes them through each attention layer's own
  cache writer (`paged.write`) before the forward;
  after each forward (`wait_for_save`) it reads the step's K/V back (`paged.Reader`) into the
  request's store entry.

Translated K/V never count as an exact prefix-cache hit: with vLLM's prefix caching on, the
blocks a connector filled would be hashed by their token ids and served to later requests as
exact, so the connector then loads nothing (saving still runs) and says so once.

Everything the worker side needs travels in the step's metadata, so one worker connector
serves every engine of a process (vLLM keeps one per process) and no request reads another
engine's settings.

Per request, `SamplingParams(extra_args={"kv_transfer_params": {"kvlingo": MODE}})` with MODE
"off" keeps the connector out of it (no load, no save: an ordinary request, e.g. to time against),
and "no-save" loads but leaves the store as it was (repeated trials of one prompt).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from ..core.engine import PRECISIONS
from . import paged
from .bench import allowed_cpus
from .contract import Contract, Refused, ServedModel, SourceModel
from .store import STORE

log = logging.getLogger("kvlingo.serve")
CONNECTOR = "KvlingoConnector"
MODULE = __name__
SOURCES = ("engine", "model")  # where a source cache comes from: the store, or the source model run here
DECISIONS: list[dict[str, Any]] = []  # every load decision and timing of this process, in order (read by tests)
_LOCK = threading.Lock()
_CONTRACTS: dict[str, Contract] = {}  # [folder, target, allow_unproven, dtype] → contract, shared by both sides
_SOURCE_MODELS: dict[tuple, SourceModel] = {}  # (name, dtype) → the source model run here


def engine_args(
    export: str | None = None,
    *,
    source: str = "engine",
    allow_unproven: bool = False,
    save: bool = True,
    whole_blocks: bool = False,
    min_tokens: int = 16,
    precision: str | None = None,
    log_file: str | None = None,
    block_size: int = 32,
) -> dict[str, Any]:
    """The `LLM(...)` / `vllm serve` settings of an engine with this connector: prefix caching off (see the
    module docstring), a failed load recomputed rather than failing the request, and the connector's own
    settings (`export`: the translator folder this engine's loads use; None: it only saves and reuses its own
    exact caches; `precision`: the translation's, `kvlingo.core.engine.PRECISIONS`, None: FP32 maths as
    `kvlingo.Relay` translates; "fast" takes the maps' matmuls in a BF16 engine's dtype)."""
    extra = {
        "export": export,
        "source": source,
        "allow_unproven": allow_unproven,
        "save": save,
        "whole_blocks": whole_blocks,
        "min_tokens": min_tokens,
        "precision": precision,
        "log_file": log_file,
    }
    return {
        "enable_prefix_caching": False,
        "block_size": block_size,
        "kv_transfer_config": {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        },
    }


def record(event: dict[str, Any], log_file: str | None = None) -> None:
    event = {"time": time.time(), **event}
    with _LOCK:
        DECISIONS.append(event)
        if log_file:
            import json

            with open(log_file, "a") as f:
                f.write(json.dumps(event) + "\n")


# --------------------------------------------------------------------------- metadata
@dataclass
class Load:
    """One request's load of its first len(ids) positions: [0, own_tokens) from this model's own exact cache as it
    is, the rest translated from a source cache (a store entry, or the source model run here on `ids`)."""

    request: str
    ids: list[int]  # the prompt's first tokens, all of them loaded (and the ids the translation reads)
    own: int | None  # store entry of this model's own exact cache (None: none is used)
    own_tokens: int  # positions taken from it
    own_exact: bool  # that entry is exact (`store.Entry.exact`)
    source: int | None  # store entry translated (None: the source model, run here, reads `ids`)
    contract: str | None  # `_CONTRACTS` key of the translator (None when nothing is translated)
    log_file: str | None = None
    precision: str | None = None  # the translation's (None: FP32 maths)
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [tokens] where they go

    @property
    def mode(self) -> str:
        if self.own_tokens == len(self.ids):
            return "own"
        return "own+translated" if self.own_tokens else "translated"


@dataclass
class Save:
    """One request's positions [start, stop) computed this step, to append to its store entry."""

    engine: str
    request: str
    model: dict[str, Any]
    exact: bool
    start: int
    ids: list[int]
    slots: torch.Tensor


@dataclass
class Meta(KVConnectorMetadata):
    block_size: int = 0  # the engine's tokens per block
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)


@dataclass
class _Tracked:
    """Scheduler-side state of a running request."""

    request: Any  # vLLM's Request (its all_token_ids grow as it decodes)
    blocks: list[int] = field(default_factory=list)
    saved: int = 0  # positions already sent to the save side
    exact: bool = True


# --------------------------------------------------------------------------- the connector
class KvlingoConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.export = extra.get("export")
        self.source = extra.get("source", "engine")
        self.allow_unproven = bool(extra.get("allow_unproven", False))
        self.save = bool(extra.get("save", True))
        self.log_file = extra.get("log_file")
        self.whole_blocks = bool(extra.get("whole_blocks", False))
        # A load shorter than this is not worth it (e.g. a chat template's first tokens, which every
        # conversation shares)
        self.min_tokens = int(extra.get("min_tokens", 16))
        self.precision = extra.get("precision")
        mc = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.granule = self.block_size if self.whole_blocks else 1  # loads fill whole blocks, or any token count
        self.engine = f"{mc.model}#{id(self)}"  # this engine in the store (two engines may serve one model)
        self.dtype = mc.dtype
        self._reader: paged.Reader | None = None
        self._load_errors: set[int] = set()
        if role != KVConnectorRole.SCHEDULER:
            return  # the worker side reads everything from the step's metadata
        self.tracked: dict[str, _Tracked] = {}
        self.plans: dict[str, Load] = {}
        self.served = ServedModel.describe(mc.model, mc.revision, mc.tokenizer, mc.tokenizer_revision, mc.hf_config)
        self.refusal, self.contract_key = self._accept(vllm_config)
        if self.refusal:
            log.warning("kvlingo connector on %s loads nothing: %s", mc.model, self.refusal)
        elif self.contract_key:
            log.info(
                "kvlingo connector on %s translates with %s (%s, refresh %s, reads %d target tensors, gate %s)",
                mc.model,
                self.export,
                self.contract.config["family"],
                self.contract.refresh,
                len(self.contract.target_weights),
                "passed" if self.contract.verdict.passed else "WAIVED",
            )

    # ------------------------------------------------------------------ scheduler side
    def _accept(self, vllm_config) -> tuple[str | None, str | None]:
        """(why this engine never loads, or None; the contract's key, or None when there is no translator)."""
        if vllm_config.cache_config.enable_prefix_caching:
            return (
                "prefix caching is on, and vLLM would hash the blocks a translation fills by their token ids and "
                "serve them to later requests as exact hits; start the engine with enable_prefix_caching=False "
                "(kvlingo.serve.connector.engine_args)"
            ), None
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            return f"kv cache dtype {vllm_config.cache_config.cache_dtype} is not supported; use auto", None
        if self.source not in SOURCES:
            return f"source {self.source!r} is not one of {SOURCES}", None
        if self.precision not in (None, *PRECISIONS):
            return f"precision {self.precision!r} is not one of {PRECISIONS}", None
        if self.export is None:
            return None, None  # saves, and reuses its own exact caches
        try:
            key, contract = _contract(self.export, self.served, self.allow_unproven, self.dtype)
        except Refused as err:
            return str(err), None
        if self.source == "model":
            try:
                _source_model(contract, self.dtype)
            except Refused as err:
                return str(err), None
        return None, key

    @property
    def contract(self) -> Contract | None:
        return _CONTRACTS.get(self.contract_key) if self.contract_key else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self.tracked.setdefault(request.request_id, _Tracked(request))
        self.plans.pop(request.request_id, None)
        plan, why = self._plan(request, num_computed_tokens)
        n = len(request.prompt_token_ids or [])
        if plan is None:
            record(
                {
                    "request": request.request_id,
                    "engine": self.served.name,
                    "prompt_tokens": n,
                    "matched": 0,
                    "mode": "prefill",
                    "reason": why,
                },
                self.log_file,
            )
            log.info("kvlingo %s on %s: prefill (%s)", request.request_id, self.served.name, why)
            return 0, False
        self.plans[request.request_id] = plan
        tokens = len(plan.ids) - num_computed_tokens
        record(
            {
                "request": request.request_id,
                "engine": self.served.name,
                "prompt_tokens": n,
                "matched": len(plan.ids),
                "own_tokens": plan.own_tokens,
                "own_exact": plan.own_exact,
                "mode": plan.mode,
                "reason": None,
            },
            self.log_file,
        )
        log.info(
            "kvlingo %s on %s: loads %d of %d prompt tokens (%d from its own cache, %d translated)",
            request.request_id,
            self.served.name,
            len(plan.ids),
            n,
            plan.own_tokens,
            len(plan.ids) - plan.own_tokens,
        )
        return tokens, False

    def _plan(self, request, num_computed: int) -> tuple[Load | None, str | None]:
        """The request's load, or (None, why not)."""
        if mode(request) == "off":
            return None, "off for this request (kv_transfer_params)"
        if self.refusal:
            return None, self.refusal
        ids = list(request.prompt_token_ids or [])
        if len(ids) < 2:
            return None, "the prompt has fewer than 2 tokens"
        contract = self.contract
        found = STORE.lookup(ids)
        # This model's own cache of the longest prefix: what it would hold had it continued the conversation itself
        # (exact when it computed all of it from the conversation; else it attended to a translation already made)
        own_entry, own = next(((e, c) for e, c in found if e.model == self.served.to_dict()), (None, 0))
        own = min(own, len(ids) - 1) // self.granule * self.granule
        own = own if own >= self.min_tokens else 0
        reasons, source, m = [], None, 0
        if contract is not None and self.source == "model":
            source, m = "model", contract.usable_tokens(len(ids), len(ids), self.granule)
        elif contract is not None:
            for entry, common in found:
                if entry.model["identity"] == self.served.identity:
                    continue
                try:
                    contract.admit(entry.model)
                except Refused as err:
                    reasons.append(str(err))
                    continue
                source, m = entry, contract.usable_tokens(common, len(ids), self.granule)
                break
        if source is not None and m > max(own, num_computed) and m >= self.min_tokens:  # past its own exact prefix
            return Load(
                request.request_id,
                ids[:m],
                own_entry.key if own else None,
                own,
                bool(own and own_entry.exact),
                None if source == "model" else source.key,
                self.contract_key,
                self.log_file,
                self.precision,
            ), None
        if own > num_computed:
            return Load(
                request.request_id, ids[:own], own_entry.key, own, own_entry.exact, None, None, self.log_file
            ), None
        if source is not None:
            reasons.append(
                f"the source cache gives {m} tokens to load, not more than {max(own, num_computed)} and at "
                f"least {self.min_tokens} (min_tokens; refresh {contract.refresh}, granule {self.granule})"
            )
        elif not found:
            reasons.append("no cache in the store shares a prefix with this prompt")
        elif contract is None:
            reasons.append("no translator is configured (export), and no exact cache of this model covers the prompt")
        return None, "; ".join(dict.fromkeys(reasons)) or "no usable cache"

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        plan = self.plans.get(request.request_id)
        if num_external_tokens == 0:
            self.plans.pop(request.request_id, None)
        elif plan is not None and request.request_id in self.tracked:  # exact only if all it loads is exact
            self.tracked[request.request_id].exact = plan.mode == "own" and plan.own_exact

    def build_connector_meta(self, scheduler_output) -> Meta:
        meta = Meta(self.block_size)
        steps = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for new in scheduler_output.scheduled_new_reqs:
            t = self.tracked.setdefault(new.req_id, _Tracked(None))
            t.blocks, t.saved = list(new.block_ids[0]), 0
            plan = self.plans.pop(new.req_id, None)
            if plan is not None:
                plan.slots = paged.slots(t.blocks, 0, len(plan.ids), self.block_size)
                meta.loads.append(plan)
            self._save(meta, new.req_id, t, new.num_computed_tokens + steps.get(new.req_id, 0))
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and resumed: a fresh block table, recomputed from 0
                t.blocks, t.saved = (list(added[0]) if added else []), 0
            elif added:
                t.blocks.extend(added[0])
            self._save(meta, req_id, t, cached.num_computed_tokens[i] + steps.get(req_id, 0))
        return meta

    def _save(self, meta: Meta, req_id: str, t: _Tracked, stop: int) -> None:
        if not self.save or t.request is None or mode(t.request) in ("off", "no-save") or stop <= t.saved:
            return
        ids = list(t.request.all_token_ids[t.saved : stop])
        meta.saves.append(
            Save(
                self.engine,
                req_id,
                self.served.to_dict(),
                t.exact,
                t.saved,
                ids,
                paged.slots(t.blocks, t.saved, stop, self.block_size),
            )
        )
        t.saved = stop

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.tracked.pop(request.request_id, None)
        self.plans.pop(request.request_id, None)
        STORE.finish(self.engine, request.request_id)
        return False, None

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, Meta) or not meta.loads or forward_context.attn_metadata is None:
            return
        layers = attention_layers(forward_context)
        for load in meta.loads:
            try:
                self._load(load, layers)
            except Exception as err:  # the engine recomputes these blocks (kv_load_failure_policy recompute)
                log.exception("kvlingo %s: load failed, recomputing: %s", load.request, err)
                record(
                    {"request": load.request, "event": "load_failed", "reason": f"{type(err).__name__}: {err}"},
                    load.log_file,
                )
                self._load_errors.update(torch.unique(load.slots // meta.block_size).tolist())

    def _load(self, load: Load, layers: list) -> None:
        started, t0 = time.time(), time.perf_counter()
        dtype, m, own = layers[0].kv_cache.dtype, len(load.ids), load.own_tokens
        parts = []  # (keys, values [layers, kv_heads, tokens, head_dim], slots)
        if own:
            parts.append((*_entry(load.own).prefix(own), load.slots[:own]))
        t1 = time.perf_counter()
        if m > own:
            contract = _CONTRACTS[load.contract]
            prenorm = None
            if load.source is None:  # the source model, run here, reads the context
                cap = _source_model(contract, dtype).capture(load.ids)
                keys, values, prenorm = cap.keys, cap.values, cap.prenorm
            else:
                entry = _entry(load.source)
                if entry.common_prefix(torch.as_tensor(load.ids, dtype=torch.long)) < m:  # the ids it translates with
                    raise RuntimeError(f"store entry {load.source} no longer holds the prompt's first {m} tokens")
                keys, values = entry.prefix(m)
            t1 = time.perf_counter()
            # [layers, tokens, kv_heads, head_dim] underneath: each layer's slice is the writer's input as it is
            keys, values = contract.translate(
                keys, values, dtype, prenorm, load.precision, token_major=True, ids=load.ids
            )
            parts.append((keys[:, :, own:], values[:, :, own:], load.slots[own:]))
        t2 = time.perf_counter()
        for keys, values, where in parts:
            if keys.shape[0] != len(layers):
                raise RuntimeError(f"{keys.shape[0]} layers of K/V for an engine with {len(layers)} attention layers")
            for layer, k, v in zip(layers, keys, values):  # k, v [kv_heads, tokens, head_dim]
                paged.write(
                    layer, k.transpose(0, 1).to(dtype), v.transpose(0, 1).to(dtype), where
                )  # no copy if token-major
        t3 = time.perf_counter()
        record(
            {
                "request": load.request,
                "event": "loaded",
                "started": started,
                "tokens": m,
                "own_tokens": own,
                "source_s": t1 - t0,
                "translate_s": t2 - t1,
                "write_s": t3 - t2,
                "threads": torch.get_num_threads(),
                "affinity": allowed_cpus(),
                "inference_mode": torch.is_inference_mode_enabled(),
            },
            load.log_file,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # the whole step is read back at once, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, Meta) or not meta.saves:
            return
        from vllm.forward_context import get_forward_context

        try:
            layers = attention_layers(get_forward_context())
        except (AssertionError, RuntimeError):
            return  # no forward ran this step
        if not layers:
            return
        reader = self._reader_for(layers[0], meta.block_size)
        if reader is None:
            return
        for save in meta.saves:
            keys, values = zip(*(reader.read(layer.kv_cache, save.slots) for layer in layers))  # [tokens, heads, dim]
            k = torch.stack(keys).transpose(1, 2)  # [layers, kv_heads, tokens, head_dim]
            v = torch.stack(values).transpose(1, 2)
            entry = STORE.entry_for(
                save.engine,
                save.request,
                save.model,
                save.exact,
                (k.shape[0], k.shape[1], k.shape[3]),
                k.dtype,
                save.start + len(save.ids),
            )
            entry.write(save.start, save.ids, k, v)

    def _reader_for(self, layer, block_size: int) -> paged.Reader | None:
        if self._reader is not None and self._reader.matches(layer.kv_cache, block_size):
            return self._reader
        try:
            self._reader = paged.Reader(layer, layer.num_kv_heads, layer.head_size, block_size)
        except paged.LayoutError as err:
            log.warning("kvlingo: this engine's cache layout cannot be read back, so it saves nothing: %s", err)
            self.save = False
            return None
        return self._reader

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors


# --------------------------------------------------------------------------- helpers
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def attention_layers(forward_context) -> list:
    """The engine's decoder attention layers that hold a cache, in layer order."""
    found = []
    for name, layer in forward_context.no_compile_layers.items():
        m = LAYER_INDEX.search(f".{name}.")
        if m and isinstance(getattr(layer, "kv_cache", None), torch.Tensor) and hasattr(layer, "impl"):
            found.append((int(m.group(1)), layer))
    return [layer for _, layer in sorted(found, key=lambda il: il[0])]


MODES = ("on", "off", "no-save")  # a request's kv_transfer_params["kvlingo"] (see the module docstring)


def mode(request) -> str:
    return (request.kv_transfer_params or {}).get("kvlingo", "on")


def _entry(key: int):
    entry = STORE.get(key)
    if entry is None:
        raise RuntimeError(f"store entry {key} was evicted before the load")
    return entry


def _contract(folder: str, served: ServedModel, allow_unproven: bool, dtype: torch.dtype) -> tuple[str, Contract]:
    """(key, contract) of a translator folder for a served model in the engine's `dtype`, loaded once per process."""
    import json

    folder = str(Path(folder).resolve())
    key = json.dumps([folder, served.to_dict(), allow_unproven, str(dtype)], sort_keys=True)
    with _LOCK:
        if key not in _CONTRACTS:
            _CONTRACTS[key] = Contract.load(folder, served, allow_unproven=allow_unproven, dtype=dtype)
        return key, _CONTRACTS[key]


def _source_model(contract: Contract, dtype: torch.dtype) -> SourceModel:
    key = (contract.source_name, dtype)
    with _LOCK:
        if key not in _SOURCE_MODELS:
            _SOURCE_MODELS[key] = SourceModel(
                contract.source_name, dtype, contract.config.get("models", {}).get("source")
            )
        return _SOURCE_MODELS[key]
