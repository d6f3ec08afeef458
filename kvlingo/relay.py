"""`Relay`: hand a conversation from one model to another through a trained, proven KV-cache translator.

    relay = Relay.load("artifacts/pilot-l2s/export")   # an exported folder, or a Hub repo id with revision=
    print(relay.chat(messages, max_new_tokens=64))      # the source reads the chat, the target answers

A relay is an exported translator folder (`kvlingo.records.saved`) bound to its pair. `load` checks,
in this order and before any weights load:

1. the maps file against its recorded sha256 (never waived);
2. the evidence against the gate (`kvlingo.records.saved`): a folder without evidence, or whose
   figures fail the thresholds, is refused unless `allow_unproven=True`;
3. the pair's tokenizer against the recorded digest (never waived: a cache is indexed by token ids);
4. the pair's identity, direction and geometry against the translator's (the one loader's checks).

The handoff is the suite's own (`kvlingo.core.handoff`): for a prompt of n tokens the source
prefills the first n-1, its cache is translated (with the refresh setting the evidence was
measured with, `config["refresh"]`), and the target reads the last token on top of it, which is
the translated arm of the benchmark and of IFEval.

A relay runs one call at a time: its calls take a lock, so threads may share one (they wait for
each other). Two relays built on the same model objects do not share that lock.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from .core.cache import Capture, build_cache
from .core.handoff import capture_source, greedy_generate, stop_ids, translate
from .core.refresh import Refresh
from .core.translator import Geometry, Translator, TranslatorError
from .inputs.models import PYTHON_API, Pair, load_pair, render_ids, resolve_pair
from .records.saved import (
    CARD_FILE,
    CONFIG_FILE,
    EVIDENCE_FILE,
    MAPS_FILE,
    Gate,
    Verdict,
    check_expected,
    judge,
    load_translator,
    model_arg,
    model_name,
    read_export,
    read_manifest,
)

if TYPE_CHECKING:
    from transformers import Cache, DynamicCache

Messages = Sequence[dict[str, Any]]  # chat messages: {"role": ..., "content": ...}
Source = Union[Messages, Sequence[int], torch.Tensor, Capture, "DynamicCache"]  # what a handoff starts from
HUB_FILES = [CONFIG_FILE, EVIDENCE_FILE, CARD_FILE, MAPS_FILE]
ROLES = ("system", "user", "assistant", "tool")  # the roles the supported chat templates render


class UnprovenTranslator(TranslatorError):
    """Maps without evidence, or whose evidence fails the gate (`allow_unproven=True` loads them anyway)."""


def _serialised(method):
    """Run a relay method under the relay's lock: a forward temporarily hooks and switches the shared
    models (`core.cache.run_with_cache`, `core.attention.using`), so two at once would mix their captures."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class Relay:
    """A translator bound to its source and target models (build one with `Relay.load`)."""

    def __init__(
        self,
        pair: Pair,
        translator: Translator,
        config: dict[str, Any],
        evidence: dict[str, Any] | None,
        verdict: Verdict,
        folder: Path,
    ):
        self.pair = pair
        self.translator = translator
        self.config = config  # the folder's config.json
        self.evidence = evidence  # its evidence.json (None when absent)
        self.verdict = verdict  # the gate's verdict on that evidence at load time
        self.folder = folder
        self.refresh = Refresh.parse(config.get("refresh"))  # what the target recomputes after the translation
        self._lock = threading.RLock()  # one call at a time (see the module docstring)

    @classmethod
    def load(
        cls,
        path_or_repo: str | Path,
        *,
        device: str = "auto",
        dtype: str | None = None,
        revision: str | None = None,
        allow_unproven: bool = False,
        large: str | None = None,
        small: str | None = None,
        gate: Gate | None = None,
    ) -> Relay:
        """Load an exported translator and its pair.

        path_or_repo: a local export folder, or a Hub repo id ("owner/name") fetched at `revision`.
        device: cuda, mps, cpu or auto. dtype: the models' dtype (default: the one the evidence was measured in).
        large/small: the pair's models (Hub id[@revision] or local folder) in place of those config.json
        records. allow_unproven: load maps without passing evidence (the hash and tokenizer checks still apply).
        gate: the thresholds the evidence must meet (default `Gate()`).
        """
        if gate is not None and not isinstance(gate, Gate):
            raise TypeError(f"gate must be a kvlingo.records.saved.Gate, got {type(gate).__name__}")
        if isinstance(device, torch.device):
            device = str(device)
        folder = locate(path_or_repo, revision)
        config, evidence, why_none = read_export(folder)
        read_manifest(folder, CONFIG_FILE)  # the maps hash, before anything else
        verdict = judge(evidence, gate or Gate())
        if not verdict.passed and not allow_unproven:
            raise UnprovenTranslator(unproven_message(folder, verdict, why_none))
        rec = config["pair"]
        pair_cfg, tok = resolve_pair(
            large or recorded(rec["large"], "large"),
            small or recorded(rec["small"], "small"),
            config["direction"],
            device,
            dtype or rec["dtype"],
            naming=PYTHON_API,
        )
        if pair_cfg.tokenizer_sha256 != rec["tokenizer_sha256"]:
            raise TranslatorError(
                f"{folder}: pair refused: its tokenizer (sha256 {pair_cfg.tokenizer_sha256[:16]}…) is "
                "not the one these "
                f"maps were trained with ({rec['tokenizer_sha256'][:16]}…); a cache is indexed by token ids. Load "
                f"the recorded pair ({model_name(rec['large'])}, {model_name(rec['small'])}) or maps "
                "trained for this one"
            )
        try:  # the loader checks these again; here they refuse before any weights load
            check_expected(
                config,
                direction=pair_cfg.direction,
                models=pair_cfg.identities(),
                geometry=Geometry(**pair_cfg.geometry),
                pair_fix=f"give large= and small= the models it was trained for ({model_name(rec['large'])}, "
                f"{model_name(rec['small'])}), or leave them out to load those",
            )
        except TranslatorError as err:
            raise TranslatorError(f"{folder}: {err}") from None
        pair = load_pair(pair_cfg, tok)
        translator, _ = load_translator(folder, pair, manifest_file=CONFIG_FILE)
        return cls(pair, translator, config, evidence, verdict, folder)

    # ------------------------------------------------------------------ the pair
    @property
    def source(self):
        return self.pair.source

    @property
    def target(self):
        return self.pair.target

    @property
    def tokenizer(self):
        return self.pair.tokenizer

    def prompt_ids(self, messages: Messages, enable_thinking: bool = False) -> list[int]:
        """The chat template's ids of `messages`, through the generation prompt."""
        return render_ids(self.tokenizer, check_messages(messages), enable_thinking)

    @_serialised
    def capture(self, ids: Sequence[int] | torch.Tensor) -> Capture:
        """The source's capture of `ids` (every one of them), with what the translator reads. For a cache that
        `target.generate(prompt, cache=...)` continues, capture the prompt's ids but its last one
        (`relay.capture(ids[:-1])`), as `handoff(ids)` does: generate feeds only the tokens past the cache."""
        ids = self._ids(ids)
        if not ids:
            raise ValueError("a capture needs at least one token id (got none)")
        return capture_source(self.source, ids, [self.translator], self.pair.cache)

    # ------------------------------------------------------------------ the handoff
    @_serialised
    def translate(
        self, source: Source, ids: Sequence[int] | torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target-layout (keys, values), each [layers, kv_heads, tokens, head_dim], of `source`: messages or
        prompt ids (the cache of all but the last token), a `Capture`, or the source's own DynamicCache.

        A cache is translated with the token ids it covers: a `Capture` from `relay.capture(ids)` holds them; a
        DynamicCache needs `ids=` (one per cached token). Maps that read the target's layer 0 of each token (the
        tokeninput family) or a refresh (exact:0 recomputes layer 0 from the ids) refuse a cache without them."""
        if isinstance(source, Capture) or hasattr(source, "layers"):
            cap = self._as_capture(source, ids)
            if cap.ids is None and (self.refresh.active or self.translator.reads_layer0):
                what = f"refresh {self.refresh}" if self.refresh.active else f"the {self.translator.family} maps"
                raise ValueError(
                    f"{what} read the context's token ids, which a bare cache lacks: pass the messages or ids, "
                    "a relay.capture(ids), or the cache with ids= (the ids it covers)"
                )
            if self.translator.needs_prenorm and cap.prenorm is None:
                raise ValueError(
                    f"these maps read the source's pre-norm key features ({self.translator.key_space} key "
                    "space), which a plain cache lacks: pass the messages or ids, or relay.capture(ids)"
                )
            context = None if cap.ids is None else cap.ids.tolist()
        else:
            if ids is not None:
                raise ValueError("ids= goes with a cache; messages and prompt ids carry their own")
            prompt = self._ids(source)
            if len(prompt) < 2:
                raise ValueError(f"a handoff needs a prompt of at least 2 tokens (got {len(prompt)})")
            cap, context = None, prompt[:-1]
        refresh = self.refresh if self.refresh.active else None
        return translate(
            self.source,
            self.translator,
            context,
            self.pair.dtype,
            cap=cap,
            refresh=refresh,
            target=self.target,
            kind=self.pair.cache,
        )

    @_serialised
    def handoff(self, source: Source, ids: Sequence[int] | torch.Tensor | None = None) -> Cache:
        """A fresh target cache of `source` (see `translate`), ready for `target.generate(ids, cache=...)` with the
        whole prompt `ids`: the target then reads only the uncached last token. It is a transformers `Cache`
        (the suite's `PreallocatedCache`, or a DynamicCache for a pair config whose cache is "dynamic"), used as a
        DynamicCache is."""
        return build_cache(self.target, *self.translate(source, ids), kind=self.pair.cache)

    @_serialised
    def reply_ids(
        self, messages: Messages, max_new_tokens: int = 256, enable_thinking: bool = False
    ) -> tuple[list[int], bool]:
        """The target's greedy reply to `messages` after the handoff: (ids without the stop token, hit the cap)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens is {max_new_tokens!r}; give a whole number, 0 or more")
        ids = self.prompt_ids(messages, enable_thinking)  # translate(ids) checks them
        limit = min(m.config.max_position_embeddings for m in (self.source, self.target))
        check_room(len(ids), max_new_tokens, limit, "the models'")
        return greedy_generate(
            self.target,
            ids[-1:],
            self.translate(ids),
            max_new_tokens=max_new_tokens,
            eos_ids=stop_ids(self.tokenizer),
            kind=self.pair.cache,
        )

    def chat(self, messages: Messages, max_new_tokens: int = 256, enable_thinking: bool = False) -> str:
        """The source reads `messages`, the target answers (greedy); returns the reply's text."""
        ids, _ = self.reply_ids(messages, max_new_tokens, enable_thinking)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @_serialised
    def native_chat(
        self, messages: Messages, model: str = "target", max_new_tokens: int = 256, enable_thinking: bool = False
    ) -> str:
        """The reply (greedy) of `model` ("target" or "source") reading `messages` itself, with no handoff: what
        `chat` is measured against."""
        if model not in ("target", "source"):
            raise ValueError(f"model is {model!r}; give 'target' or 'source'")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens is {max_new_tokens!r}; give a whole number, 0 or more")
        ids = self.prompt_ids(messages, enable_thinking)
        net = self.target if model == "target" else self.source
        check_room(len(ids), max_new_tokens, net.config.max_position_embeddings, f"the {model}'s")
        ids = self._in_range(ids)
        out, _ = greedy_generate(
            net, ids, max_new_tokens=max_new_tokens, eos_ids=stop_ids(self.tokenizer), kind=self.pair.cache
        )
        return self.tokenizer.decode(out, skip_special_tokens=True)

    def _ids(self, source: Source) -> list[int]:
        """Token ids of messages or ids, checked: whole numbers the models embed, no longer than both read."""
        if torch.is_tensor(source):
            if source.dim() > 2 or (source.dim() == 2 and source.shape[0] != 1):
                raise ValueError(
                    f"prompt ids have shape {tuple(source.shape)}; a relay is batch-one ([tokens] or [1, tokens])"
                )
            if source.dtype.is_floating_point or source.dtype.is_complex or source.dtype == torch.bool:
                raise ValueError(f"prompt ids are a {source.dtype} tensor; pass token ids as integers (torch.long)")
            ids = source.reshape(-1).tolist()
        else:
            if isinstance(source, (str, bytes)) or not isinstance(source, Iterable):
                raise ValueError(
                    f"a handoff starts from chat messages, token ids, a Capture or the source's cache; "
                    f"got {type(source).__name__}"
                )
            source = list(source)
            if source and isinstance(source[0], dict):
                return self._in_range(self.prompt_ids(source))
            ids = [_token_id(i) for i in source]
        return self._in_range(ids)

    def _in_range(self, ids: list[int]) -> list[int]:
        vocab = min(m.get_input_embeddings().num_embeddings for m in (self.source, self.target))
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # builtins: no per-token Python on the handoff's path
            bad = next(i for i in ids if not 0 <= i < vocab)
            raise ValueError(
                f"token id {bad} is outside the models' vocabulary [0, {vocab}); "
                "ids must come from the pair's tokenizer (relay.tokenizer)"
            )
        limit = min(m.config.max_position_embeddings for m in (self.source, self.target))
        if len(ids) > limit:
            raise ValueError(
                f"the prompt is {len(ids)} tokens, more than the models read "
                f"(max_position_embeddings {limit}); shorten the conversation to at most {limit} tokens"
            )
        return ids

    def _as_capture(self, source: Any, ids=None) -> Capture:
        if isinstance(source, Capture):
            cap = source
        else:  # a transformers cache: [1, kv_heads, tokens, head_dim] per layer
            if not source.layers or any(getattr(layer, "keys", None) is None for layer in source.layers):
                raise ValueError(
                    "the source cache is empty: prefill the source model on the context first, or pass "
                    "the messages or ids"
                )
            cap = Capture(
                torch.stack([layer.keys[0] for layer in source.layers]),
                torch.stack([layer.values[0] for layer in source.layers]),
                None,
                torch.empty(0),
            )
        self._check_capture(cap)
        if ids is not None:
            given = self._ids(ids)
            if cap.ids is not None and given != cap.ids.tolist():
                raise ValueError("ids= differ from the ids the capture holds; pass the capture alone")
            if len(given) != cap.n_tokens:
                raise ValueError(
                    f"ids= has {len(given)} token ids but the cache holds {cap.n_tokens} tokens; pass the ids it covers"
                )
            cap = replace(cap, ids=torch.as_tensor(given, device=cap.keys.device))
        return cap

    def _check_capture(self, cap: Capture) -> None:
        """Refuse a capture (or cache) that is not the source model's: another depth, KV-head count or head
        size, or parts of different lengths."""
        g = self.translator.geometry
        want = (g.source_layers, g.source_kv_heads, None, g.source_head_dim)
        parts = {
            "keys": cap.keys,
            "values": cap.values,
            **({"prenorm": cap.prenorm} if cap.prenorm is not None else {}),
        }
        for name, t in parts.items():
            if (
                t.dim() != 4
                or any(w is not None and s != w for s, w in zip(t.shape, want))
                or t.shape[2] != cap.keys.shape[2]
                or t.shape[2] == 0
            ):
                raise ValueError(
                    f"the source {name} are {list(t.shape)}; this relay's source caches "
                    f"[layers={g.source_layers}, kv_heads={g.source_kv_heads}, tokens ≥ 1, "
                    f"head_dim={g.source_head_dim}] with the same tokens in keys and values: pass a "
                    "Capture or cache of this relay's source model (relay.capture(ids))"
                )

    def __repr__(self) -> str:
        rec = self.config["pair"]
        return (
            f"Relay({self.config['family']} {self.config['direction']}: {model_name(rec['large'])} ↔ "
            f"{model_name(rec['small'])}, gate {'passed' if self.verdict.passed else 'FAILED'}, {self.folder})"
        )


# --------------------------------------------------------------------------- helpers
def _token_id(i: Any) -> int:
    """An int, NumPy or 0-d torch integer as a token id; anything else (1.5, "7", True) is refused, never rounded."""
    try:
        if isinstance(i, bool) or (torch.is_tensor(i) and i.dtype == torch.bool):
            raise TypeError
        return operator.index(i)
    except TypeError:
        raise ValueError(f"prompt ids must be integers, got {i!r}; pass token ids or chat messages") from None


def check_room(n: int, max_new_tokens: int, limit: int, whose: str) -> None:
    """Refuse a prompt of `n` tokens whose reply of up to `max_new_tokens` would run past `limit` positions,
    naming what fits: a shorter conversation, and a lower max_new_tokens only where a positive one fits."""
    if n + max_new_tokens <= limit:
        return
    room, keep = limit - n, limit - max_new_tokens  # new tokens after this prompt; prompt tokens before this reply
    fixes = [f"give max_new_tokens={room} or less"] if room > 0 else []
    fixes += [f"shorten the conversation to at most {keep} tokens"] if keep > 0 else []
    fixes = fixes or [f"shorten the conversation and give max_new_tokens below {limit}"]
    what = (
        f"the prompt alone is {n} tokens, more than {whose} {limit} positions"
        if n > limit
        else f"the prompt is {n} tokens and max_new_tokens {max_new_tokens}: the reply would run past {whose} "
        f"{limit} positions"
    )
    raise ValueError(f"{what}; {', or '.join(fixes)}")


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages as a list, each a {"role": one of ROLES, "content": str} dict; anything else is refused with
    the message's index and what is wrong (a chat template would fail on it, or render it as it likes)."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Iterable):
        raise ValueError(
            f"chat messages are a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}; token ids go to relay.handoff"
        )
    messages = list(messages)
    if not messages:
        raise ValueError("the chat is empty: give at least one {'role': 'user', 'content': ...} message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(
                f"chat message {i} is {type(m).__name__} {m!r}, not a {{'role': ..., 'content': ...}} dict"
                + ("; token ids go to relay.handoff" if isinstance(m, int) else "")
            )
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"chat message {i} has {key} {m.get(key)!r}; give it as a string")
        if m["role"] not in ROLES:  # a chat template renders an unknown role as it likes, or not at all
            raise ValueError(f"chat message {i} has role {m['role']!r}; give one of {', '.join(ROLES)}")
        if not m["content"].strip():
            raise ValueError(f"chat message {i} ({m['role']}) is empty; give it some text, or leave it out")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("the chat has no user message: the target would have nothing to answer; add one")
    return messages


def locate(path_or_repo: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id fetched with huggingface_hub at `revision`."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {path} is a local folder")
        return path
    text = str(path_or_repo)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise TranslatorError(f"{text}: no such folder, and not a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=HUB_FILES))
    except (OSError, ValueError) as err:
        raise TranslatorError(
            f"{text}: no such local folder, and the Hub repo could not be fetched at revision {revision or 'main'} "
            f"({type(err).__name__}: {err}). Check the id and revision; with HF_HUB_OFFLINE=1 only a repo already "
            "in the local cache loads"
        ) from None


def recorded(identity: dict[str, Any], role: str) -> str:
    """The recorded `role` model as a model argument (a missing local folder: `TranslatorError`)."""
    return model_arg(identity, role, f"pass {role}= a folder holding the same weights", TranslatorError)


def unproven_message(folder: Path, verdict: Verdict, why_none: str | None) -> str:
    if why_none is not None:
        return (
            f"{folder}: refusing maps without evidence ({why_none}). Fix: benchmark the run and export it with "
            "its figures (`make benchmark export RUN=...`), or pass allow_unproven=True to use it anyway"
        )
    return (
        f"{folder}: refusing maps that fail the evidence gate: {'; '.join(verdict.failures)}. Fix: train better "
        "maps (more data or updates; `make recipe` searches the rate), benchmark and export them again, or pass "
        "allow_unproven=True to use these anyway"
    )
