"""Token identity as an input: a linear family plus the target's own per-token features.

A source's cache carries each token's identity only through the source's own representation
of it, which a map must turn into the target's. The target's exact layer-0 features carry it
directly, from the token ids alone (kvlingo.core.layer0): t = [k_proj(h), v_proj(h)] of its
first layer, h = input_layernorm(embed(token)), a linear image of h that keeps all of it when
2 · kv width ≥ hidden (Qwen3-0.6B and 1.7B). With `window` w > 1 the features of the w − 1
tokens before each token are appended (zeros before the first), for keys that encode the
previous token. Every target layer's map reads them beside the source's features:

    y_l = base_l(x) + T_l(t)      T_l(t) = t M_l            (full: M_l [w·d_t, H_t·d_t])
                                  T_l(t) = (t P) Q_l        (rank r: P [w·d_t, r] shared by the layers, Q_l [r,
                                  H_t·d_t])

separately for keys and values. The base is headwise, crosshead or crosslayer.

Closed form: one least-squares problem per block of the base with the token features appended
to its design, [x, t, 1] → y (kvlingo.core.fit). The base's part of the solution goes to the
base (a rank-r cross-layer base keeps the reduced-rank solution of its own rows); the token
part, one M per block, is stacked over layers (and heads) and reduced to rank r by
`fit.reduced_rank` under the token features' second moment. Where 2 · kv width > hidden (Qwen3-0.6B; the deep
toy pair's small model) the features take only the column space of layer 0's [W_k; W_v]: the problem is solved in a
basis of it (`feature_span`, `fit.NormalEquations.in_basis`), the minimum-norm solution, and the maps carry no
weight on the other directions, which hold the features' rounding alone. Distillation trains everything.

Cost: the base's FLOPs plus 2 · 2 · (w·d_t·r + L·r·d_out) per token at rank r (2 · 2 · L · w·d_t
· d_out at full rank). The features themselves are layer 0's k and v projections: the work of
the exact:0 refresh, which a handoff with these maps runs anyway; `layer0.flops_per_token`
prices it, and the ablation counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...cache import Capture
from ...fit import NormalEquations, reduced_rank
from ...preallocated import ValueMaps
from ...settings import half_target_width
from ...translator import PARTS, Geometry, LinearFamily, Part, Translator, TranslatorError
from .. import FAMILIES
from . import BASES

PARTS_WITH_TOKENS = {"both": PARTS, "keys": (Part.KEYS,), "values": (Part.VALUES,)}  # --token-parts
TOKEN_CHOICES = ("first", "last", "fit")  # --token-choice: which --token-layers N layers read the features


class TokenInput(LinearFamily):
    family = "tokeninput"

    def __init__(
        self,
        geometry: Geometry,
        key_space: str = "prenorm",
        base: dict | None = None,
        rank: int | None = None,
        window: int = 3,
        token_parts: str = "both",
        token_layers: int = 0,
        token_choice: str = "first",
    ):
        super().__init__(geometry, key_space)
        base = base or {"family": "headwise", "settings": {}}
        rank = half_target_width(geometry) if rank is None else rank
        if base.get("family") not in BASES:
            raise TranslatorError(
                f"token input needs a linear base family ({', '.join(BASES)}), not "
                f"{base.get('family')!r}; pass --base crosshead (or headwise, crosslayer)"
            )
        self.base = FAMILIES[base["family"]].from_spec(geometry, key_space, base.get("settings", {}))
        g = geometry
        self.d_tok = window * 2 * g.target_kv_heads * g.target_head_dim
        self.d_out = g.target_kv_heads * g.target_head_dim
        if window < 1:
            raise TranslatorError(f"window {window}: give at least 1 token")
        if token_parts not in PARTS_WITH_TOKENS:
            raise TranslatorError(f"token parts {token_parts!r}: give one of {', '.join(PARTS_WITH_TOKENS)}")
        if not 0 <= token_layers <= g.target_layers:
            raise TranslatorError(f"token layers {token_layers}: give 0 (all) to {g.target_layers}")
        if token_choice not in TOKEN_CHOICES:
            raise TranslatorError(f"token choice {token_choice!r}: give one of {', '.join(TOKEN_CHOICES)}")
        if token_choice != "first" and not 0 < token_layers < g.target_layers:
            raise TranslatorError(
                f"token choice {token_choice} picks N of the target's {g.target_layers} layers: give --token-layers N, "
                f"1 to {g.target_layers - 1} (0, all of them, leaves nothing to choose)"
            )
        L = token_layers or g.target_layers  # the target layers with a token term: the first L, the last L, or chosen
        if rank < 0 or rank > min(self.d_tok, L * self.d_out):
            raise TranslatorError(f"token rank {rank} must be 0 (full) or at most {min(self.d_tok, L * self.d_out)}")
        self.rank, self.window, self.token_parts, self.token_layers = rank, window, token_parts, token_layers
        self.token_choice = token_choice
        self.tok_parts = PARTS_WITH_TOKENS[token_parts]  # the parts (keys, values) that read the token features
        self.n_tok_layers = L
        if token_choice == "fit":  # the chosen target layers, ascending (the first L until the closed form chooses)
            self.register_buffer("token_layer_index", torch.arange(L))
        if rank:
            self.tok_down = nn.Parameter(torch.zeros(2, self.d_tok, rank))
            self.tok_up = nn.Parameter(torch.zeros(2, L, rank, self.d_out))
        else:
            self.tok_weight = nn.Parameter(torch.zeros(2, L, self.d_tok, self.d_out))
        self.layer0 = None  # the target's exact first layer (layer0.ContextFree), bound by `bind`
        self._memo: tuple | None = None  # (ids, features) of the capture being translated
        self._own: tuple | None = None  # (ids, own features) of the capture being translated
        self._down: dict = {}  # (part, compute dtype) → (ids, tok_down version, t P): the shared down-projection

    def settings(self) -> dict[str, Any]:
        return {
            "base": {"family": self.base.family, "settings": self.base.settings()},
            "rank": self.rank,
            "window": self.window,
            "token_parts": self.token_parts,
            "token_layers": self.token_layers,
            "token_choice": self.token_choice,
        }

    def flops_per_token(self, part: Part | None = None) -> float:
        parts = PARTS if part is None else (part,)
        return self.base.flops_per_token(part) + self._token_flops(self.n_tok_layers) * sum(
            p in self.tok_parts for p in parts
        )

    def flops_per_token_without(self, own_layers: Sequence[int] = ()) -> float:
        """The base's layers but `own_layers`, and the token term of the chosen layers but those: a layer the target
        computes itself costs its token maps only where it has them. A closed-form choice (`choose_from`) never picks
        such a layer: its N layers cost N, before the choice (at the real shapes) as after it."""
        if self.token_choice == "fit":
            kept = self.n_tok_layers
        else:
            kept = len(set(self.chosen_layers()) - set(own_layers))
        return self.base.flops_per_token_without(own_layers) + self._token_flops(kept) * len(self.tok_parts)

    def _token_flops(self, n_layers: int) -> float:
        """The token term of keys or values in `n_layers` layers, per token (a low rank's down-projection is shared)."""
        if not n_layers:
            return 0.0
        if self.rank:
            return 2.0 * (self.d_tok * self.rank + n_layers * self.rank * self.d_out)
        return 2.0 * n_layers * self.d_tok * self.d_out

    def bind(self, source, target) -> TokenInput:
        from ... import layer0

        super().bind(source, target)
        self.base.space = self.space
        try:
            self.layer0 = layer0.of(target)
        except layer0.NotContextFree as err:
            raise TranslatorError(f"token input reads the target's layer 0 from the token ids: {err}") from None
        return self

    # ------------------------------------------------------------------ translation
    @property
    def fast_paths(self) -> bool:  # type: ignore[override]
        """The engine's `fast` path where the base has one (head-wise, cross-layer): the base's maps and the token
        term's two matmuls take their inputs in the run dtype, and the term is added in it (keys: inside the
        compiled finish, in FP32)."""
        return self.base.fast_paths

    def features(self, cap: Capture) -> torch.Tensor:
        """The token features t [tokens, w · 2 · kv width], FP32 (computed once per capture)."""
        if self._memo is not None and self._memo[0] is cap.ids:
            return self._memo[1]
        t = self.own_features(cap)  # [T, 2·kvw]
        parts = [t] + [torch.cat([t.new_zeros(min(s, t.shape[0]), t.shape[1]), t[:-s]]) for s in range(1, self.window)]
        feats = torch.cat(parts, -1)
        self._memo = (cap.ids, feats)
        return feats

    def own_features(self, cap: Capture) -> torch.Tensor:
        """Each token's own layer-0 features [tokens, 2 · kv width], FP32 (the first part of the window; computed
        once per capture)."""
        if cap.ids is None:
            raise TranslatorError(
                "token input needs the captured token ids (Capture.ids), which a bare cache lacks: "
                "hand over from the messages or ids, or capture with relay.capture(ids) or "
                "kvlingo.core.cache.capture"
            )
        if self._own is not None and self._own[0] is cap.ids:
            return self._own[1]
        t = self.layer0.token_features(cap.ids).float()
        self._own = (cap.ids, t)
        return t

    def layer0_projections(self, cap: Capture) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's layer-0 k_proj and v_proj of the captured ids [tokens, kv width] each, from the token's own
        features (so that a handoff under exact:0 computes them once for both)."""
        return self.own_features(cap).chunk(2, dim=-1)

    def token_term(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        """T_l(t) for target `layers` (within the first `n_tok_layers`): [n, heads, tokens, head_dim]."""
        x, w = self._token_operands(part, cap, layers)
        y = torch.einsum("tr,nro->nto", x, w)
        g = self.geometry
        return y.view(y.shape[0], y.shape[1], g.target_kv_heads, g.target_head_dim).transpose(1, 2)

    def _token_operands(self, part: Part, cap: Capture, layers: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The token term's input [tokens, rank or token width] and its maps for `layers` [n, same, heads · d]."""
        if self.rank:
            return self.down_projection(part, cap), self.cast(self.tok_up)[part, layers]
        return self.features(cap).to(self._compute), self.cast(self.tok_weight)[part, layers]

    def map_into_via(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor, scratch: torch.Tensor) -> None:
        """Into a token-major `out` (an engine's cache, [n, tokens, heads, head_dim] underneath): the token term is
        written straight into it, as its product's own layout is token-major, and the base's head-major maps are
        mapped into `scratch` and added. The same bits as `map_into` then a copy: each element is the one sum of
        the same two operands (the batched product with `out` gives the einsum's bits, `test_tokeninput`)."""
        tok = self._token_layers(part, layers)
        n, H, T, d = out.shape
        rows = out.transpose(1, 2)
        if (
            self.token_choice != "first"
            or tok is None
            or tok.stop - tok.start != n
            or not rows.is_contiguous()
            or out.dtype != self._compute
        ):
            return super().map_into_via(part, cap, layers, out, scratch)
        x, w = self._token_operands(part, cap, tok)
        torch.bmm(x.expand(n, *x.shape), w, out=rows.view(n, T, H * d))
        self.base.map_into(part, cap, layers, scratch)
        out.add_(scratch)

    def down_projection(self, part: Part, cap: Capture) -> torch.Tensor:
        """t P of the captured ids for `part`, [tokens, rank] in the compute dtype: the input every layer's token
        term shares. Without gradients it is computed once per capture, part and dtype, however many chunks of
        layers the engine translates (at Qwen3-0.6B's shapes on a CPU, one layer per chunk: 27 times otherwise);
        the same bits, as the same product is taken of the same operands."""
        key, grad = (int(part), self._compute), torch.is_grad_enabled()
        hit = None if grad else self._down.get(key)
        if hit is not None and hit[0] is cap.ids and hit[1] == self.tok_down._version:
            return hit[2]
        if self._compute == torch.float32 or grad:
            y = self.features(cap).to(self._compute) @ self.cast(self.tok_down)[part]  # [tokens, rank]
        else:
            y = self._windowed_down(part, cap)
        if not grad:
            self._down[key] = (cap.ids, self.tok_down._version, y)
        return y

    def _windowed_down(self, part: Part, cap: Capture) -> torch.Tensor:
        """t P under a compute dtype below FP32 (the engine's `fast` paths), without the window's concatenated
        features: t P = Σ_s shift_s(t_own P_s) over the window's offsets s (P_s: the rows of P that read the token s
        places back), so one matmul of the own features [tokens, 2 · kv width] against the blocks side by side
        [2 · kv width, w · rank], then w − 1 shifted adds, summed in FP32 and rounded once. The same FLOPs; a third
        of the input to cast and no concatenation (at Qwen3-0.6B's shapes and 4,096 tokens, 24 MiB instead of
        96 MiB)."""
        w, r = self.window, self.rank
        width = self.d_tok // w
        blocks = self.cast(self.tok_down)[part].view(w, width, r).permute(1, 0, 2).reshape(width, w * r)
        z = self.own_features(cap).to(self._compute) @ blocks  # [tokens, w · rank]
        y = z[:, :r].to(torch.promote_types(z.dtype, torch.float32))  # summed in FP32 at least
        for s in range(1, min(w, y.shape[0])):
            y[s:] += z[:-s, s * r : (s + 1) * r]
        return y.to(self._compute)

    def _token_layers(self, part: Part, layers: slice) -> slice | None:
        """The layers of `layers` (a slice of the target's) that get a token term, as a slice of the same run (the
        first L layers; `_token_rows` for chosen ones)."""
        start, stop, _ = layers.indices(self.geometry.target_layers)
        end = min(stop, self.n_tok_layers)
        return slice(start, end) if part in self.tok_parts and end > start else None

    def chosen_layers(self) -> list[int]:
        """The target layers whose maps read the token features, ascending."""
        if self.token_choice == "fit":
            return self.token_layer_index.tolist()
        if self.token_choice == "last":
            return list(range(self.geometry.target_layers - self.n_tok_layers, self.geometry.target_layers))
        return list(range(self.n_tok_layers))

    def _token_rows(self, part: Part, layers: slice) -> tuple[torch.Tensor, list[int]] | None:
        """Under chosen layers (token choice last or fit): the rows of the chunk `layers` that read the token features
        and their maps' indices, ([rows], [indices]); None for the first L layers (`_token_layers`)."""
        if self.token_choice == "first":
            return None
        start, stop, _ = layers.indices(self.geometry.target_layers)
        chosen = self.chosen_layers() if part in self.tok_parts else []
        hit = [(l - start, i) for i, l in enumerate(chosen) if start <= l < stop]
        at = torch.tensor(
            [r for r, _ in hit], dtype=torch.long, device=(self.tok_up if self.rank else self.tok_weight).device
        )
        return at, [i for _, i in hit]

    def map(self, part: Part, cap: Capture, layers: slice) -> torch.Tensor:
        y = self.base.map(part, cap, layers)
        rows = self._token_rows(part, layers)
        if rows is not None:  # chosen layers: each row of the chunk that reads the features gets its term
            at, params = rows
            return y.index_add(0, at, self.token_term(part, cap, params).to(y.dtype)) if params else y
        tok = self._token_layers(part, layers)
        if tok is None:
            return y
        n = tok.stop - tok.start
        if n == y.shape[0]:
            return y + self.token_term(part, cap, tok)
        return torch.cat([y[:n] + self.token_term(part, cap, tok), y[n:]])

    def map_into(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor) -> None:
        """`map` written into `out`: the base's maps straight into it, then the token term added in place. The same
        bits as `map` (each element is the same one sum of the same two operands), without its two temporaries of
        the chunk's size (the sum and the copy). Chosen layers: each chosen row's term added in place (`index_add_`,
        the same one sum)."""
        rows = self._token_rows(part, layers)
        if rows is not None:
            self.base.map_into(part, cap, layers, out)
            if rows[1]:
                out.index_add_(0, rows[0], self.token_term(part, cap, rows[1]).to(out.dtype))
            return
        term = self._base_into(part, cap, layers, out)
        if term is not None:
            out[: term.shape[0]].add_(term)

    def map_keys_into(self, cap: Capture, layers: slice, out: torch.Tensor) -> torch.Tensor | None:
        """The base's key maps into `out` and the token term returned, for the compiled finish to add (a chunk whose
        layers do not all read the token features gets its partial sum in place, and None)."""
        if self.token_choice != "first":
            self.map_into(Part.KEYS, cap, layers, out)
            return None
        term = self._base_into(Part.KEYS, cap, layers, out)
        if term is None or term.shape[0] == out.shape[0]:
            return term
        out[: term.shape[0]].add_(term)
        return None

    def _base_into(self, part: Part, cap: Capture, layers: slice, out: torch.Tensor) -> torch.Tensor | None:
        """The base's maps written into `out`; the token term of the first layers of the chunk that read the token
        features ([n ≤ chunk, heads, tokens, head_dim]), or None when none does."""
        self.base.map_into(part, cap, layers, out)
        tok = self._token_layers(part, layers)
        return None if tok is None else self.token_term(part, cap, tok)

    # ------------------------------------------------------------------ deferred values
    def value_maps(self) -> ValueMaps | None:
        """The base's value maps with the token term (`ValueMaps.token_weight`): the token features' values map
        applied to each query row's mix of them (their down-projection, `deferred_token_input`, happens once). Chosen
        layers: the maps of the layers up to the last chosen one, zero where a layer reads no features."""
        maps = self.base.value_maps()
        if maps is None or Part.VALUES not in self.tok_parts:
            return maps
        g = self.geometry
        w = (self.tok_up if self.rank else self.tok_weight)[Part.VALUES].detach()  # [token layers, width, H·d]
        token_weight = w.view(*w.shape[:2], g.target_kv_heads, g.target_head_dim).permute(0, 2, 1, 3)
        if self.token_choice != "first":  # chosen layers: zero maps below the last chosen layer where none is
            chosen = self.chosen_layers()
            spread = token_weight.new_zeros(chosen[-1] + 1, *token_weight.shape[1:])
            spread[chosen] = token_weight
            token_weight = spread
        return replace(maps, token_weight=token_weight)  # [token layers, H, width, d]

    def deferred_input_flops_per_token(self) -> float:
        return 2.0 * self.d_tok * self.rank if self.rank and Part.VALUES in self.tok_parts else 0.0

    def deferred_token_input(self, cap: Capture) -> torch.Tensor | None:
        """The per-token input of the values' token term, [tokens, rank or token width] in FP32."""
        if Part.VALUES not in self.tok_parts:
            return None
        t = self.features(cap)
        return t @ self.tok_down[Part.VALUES].detach() if self.rank else t

    # ------------------------------------------------------------------ closed form
    @property
    def needs_plan(self) -> bool:
        return self.base.needs_plan

    @property
    def k(self) -> int:
        """Source layers per target layer of a cross-layer base (what the layer ranking keeps)."""
        return self.base.k

    @property
    def plan(self) -> torch.Tensor:
        return self.base.plan

    def set_plan(self, layers) -> None:
        self.base.set_plan(layers)

    def fit_blocks(self) -> tuple[int, int, int, int]:
        L, B, d_in, d_out = self.base.fit_blocks()
        return L, B, d_in + self.d_tok, d_out

    def design(self, part: Part, cap: Capture) -> torch.Tensor:
        x = self.base.design(part, cap)  # [L, B, T, d_in]
        t = self.features(cap)  # [T, d_tok]
        return torch.cat([x, t.expand(*x.shape[:2], *t.shape)], -1)

    def block_targets(self, y: torch.Tensor) -> torch.Tensor:
        return self.base.block_targets(y)

    def block_weights(self, w):
        return self.base.block_weights(w)

    def feature_span(self) -> torch.Tensor | None:
        """An orthonormal basis [d_tok, k] of the directions the token features take (FP64): the target layer 0's
        (`layer0.ContextFree.feature_span`) at each place of the window. None when that is all of them."""
        own = self.layer0.feature_span()
        return None if own is None else torch.block_diag(*[own] * self.window)

    def _in_span(self, ne: NormalEquations) -> tuple[NormalEquations, torch.Tensor | None]:
        """Token features of lower rank than their width (2 · KV width > hidden): the problem on the directions they
        take (its solution the minimum-norm one), so the token maps carry no weight on directions only rounding
        reaches; `ne` itself where they take all of them. Returns it and the span [d_tok, k] (None: all of them)."""
        span = self.feature_span()
        if span is None:
            return ne, None
        d_in = ne.d_in - self.d_tok
        basis = torch.zeros(ne.d_in + 1, d_in + span.shape[1] + 1, dtype=torch.float64)
        basis[:d_in, :d_in] = torch.eye(d_in, dtype=torch.float64)
        basis[d_in : ne.d_in, d_in:-1] = span
        basis[-1, -1] = 1.0
        return ne.in_basis(basis), span

    @property
    def chooses_layers(self) -> bool:
        return self.token_choice == "fit"

    def choose_from(
        self, fit: NormalEquations, held_out: NormalEquations | None, ridge, native_layers: tuple[int, ...] = ()
    ) -> dict | None:
        """Token choice fit: the `token_layers` target layers whose held-out error the token features lower most,
        chosen before the solve (`fit_closed_form`). Each layer is solved on `fit`'s conversations with and without
        the features, at the ridge the fit chose, and scored on `held_out`'s: the share of the base's held-out error
        (Σ over KV heads) that the features remove, averaged over the parts that read them. `native_layers` (the
        layers the handoff takes from the target itself: layer 0 under exact:0, whose own features the token term
        reproduces exactly) are never chosen. Sets the layers and returns each layer's share and the choice; None
        for the first or last L layers (nothing to choose)."""
        if self.token_choice != "fit":
            return None
        open_layers = self.geometry.target_layers - len(set(native_layers))
        if self.n_tok_layers > open_layers:
            raise TranslatorError(
                f"token choice fit picks {self.n_tok_layers} layers, but only {open_layers} are translated (the "
                f"target computes layers {sorted(set(native_layers))} itself): give --token-layers {open_layers} "
                "or fewer"
            )
        if held_out is None:
            raise TranslatorError(
                "token choice fit chooses its layers on held-out fit conversations: train with --ridge auto "
                "(the default), or give --token-choice first"
            )
        d_in = fit.d_in - self.d_tok
        (fit, _), (held_out, _) = self._in_span(fit), self._in_span(held_out)
        keep = list(range(d_in)) + [fit.d_in]  # the base's rows and the bias
        full = fit.solve_augmented(ridge)  # [2, L, B, rows, d_out]
        alone = torch.zeros_like(full)
        alone[..., keep, :] = fit.solve_subset(ridge, keep)
        without, within = held_out.held_out_error(alone).sum(-1), held_out.held_out_error(full).sum(-1)  # [2, L]
        parts = list(self.tok_parts)
        share = ((without - within) / without.clamp_min(torch.finfo(torch.float64).tiny))[parts].mean(0)  # [L]
        open_share = share.clone()
        open_share[list(native_layers)] = -torch.inf
        chosen = sorted(open_share.topk(self.n_tok_layers).indices.tolist())
        self.token_layer_index.copy_(torch.tensor(chosen))
        return {
            "chosen": chosen,
            "held_out_share_removed": share.tolist(),
            "held_out_tokens": held_out.n_tokens,
            "native_layers": sorted(set(native_layers)),
        }

    def solve_from(self, ne: NormalEquations, ridge) -> None:
        """The token features' blocks (the parts and the layers that read them) solved with them; every other
        block solved on the base's inputs alone, so that its base map does not count on a token term it lacks."""
        d_in = ne.d_in - self.d_tok
        ne, span = self._in_span(ne)
        sol = ne.solve_augmented(ridge)  # [2, L, B, d_in + (d_tok or the span's k) + 1, d_out]
        keep = list(range(d_in)) + [ne.d_in]  # the base's rows and the bias
        with_tokens = torch.zeros(sol.shape[:2], dtype=torch.bool)  # [2, L]: blocks that read the token features
        chosen = self.chosen_layers()
        for part in self.tok_parts:
            with_tokens[part, chosen] = True
        base_sol = sol[..., keep, :].clone()
        if not bool(with_tokens.all()):
            alone = ne.solve_subset(ridge, keep)  # [2, L, B, d_in + 1, d_out]
            base_sol[~with_tokens] = alone[~with_tokens]
        base_A = ne.A.cpu()[..., keep, :][..., keep]
        _set_base(self.base, base_sol, base_A)
        tok = sol[:, chosen][:, :, :, d_in : ne.d_in, :]  # [2, L_tok, B, d_tok or k, d_out_block]
        two, L, B, dt, db = tok.shape
        m = tok.permute(0, 3, 1, 2, 4).reshape(two, dt, L, B * db)  # [2, d_tok, L_tok, d_out]: heads side by side
        with torch.no_grad():
            if self.rank:
                # The features' second moment in the first block: every block's under a uniform fit of raw values;
                # layer 0's, KV head 0's under attention weighting or the output value fit, which weigh blocks apart.
                A_tok = ne.A.cpu()[:, 0, 0, d_in : ne.d_in, d_in : ne.d_in]
                down, up = reduced_rank(m.reshape(two, dt, L * B * db), A_tok, self.rank)
                self.tok_down.copy_((down if span is None else span @ down).float())
                self.tok_up.copy_(up.view(two, self.rank, L, B * db).transpose(1, 2).float())
            else:
                full = m.transpose(1, 2)  # [2, L_tok, d_tok, d_out]
                self.tok_weight.copy_((full if span is None else span @ full).float())
            for part in PARTS:  # a part without a token term keeps zero maps (never read)
                if part not in self.tok_parts:
                    for p in (self.tok_down, self.tok_up) if self.rank else (self.tok_weight,):
                        p[part].zero_()


def _set_base(base: Translator, sol: torch.Tensor, A: torch.Tensor) -> None:
    """The base family's parameters from its augmented solution [2, L, B, d_in + 1, d_out] (FP64)."""
    with torch.no_grad():
        if base.family == "headwise":
            base.set_solution(sol[..., :-1, :], sol[..., -1, :])
        elif base.rank:
            left, right = reduced_rank(sol[:, :, 0], A[:, :, 0], base.rank)
            base.down.copy_(left[..., :-1, :].float())
            base.up.copy_(right.float())
            base.bias.copy_((left[..., -1:, :] @ right)[..., 0, :].float())
        else:
            base.weight.copy_(sol[:, :, 0, :-1, :].float())
            base.bias.copy_(sol[:, :, 0, -1, :].float())
