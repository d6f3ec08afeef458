"""Token identity as an input: the closed form against torch.linalg.lstsq on [source features, token features, 1]
and against a planted relation for every part and layer choice, the translation against the same design, the
shared low rank on a planted relation, the features against the target's own layer 0, and the folder round trip."""

from __future__ import annotations

import pytest
import torch
from refs import lstsq_blocks
from tinypair import chat_rows, load_tiny_pair

from kvlingo.core.cache import Capture, capture
from kvlingo.core.families.tokeninput.maps import TokenInput
from kvlingo.core.fit import NormalEquations
from kvlingo.core.layer0 import ContextFree
from kvlingo.core.settings import Geometry, Part
from kvlingo.core.translator import TranslatorError
from kvlingo.records.saved import load_translator, save_translator
from kvlingo.train.closed_form import fit_closed_form
from kvlingo.train.distill import distill_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread per module


GEOM = Geometry(
    source_layers=3, source_kv_heads=2, source_head_dim=6, target_layers=3, target_kv_heads=2, target_head_dim=4
)


class TableLayer0:
    """Stands in for layer0.ContextFree: each token id's features from a fixed random table."""

    def __init__(self, d: int, vocab: int = 50, seed: int = 0):
        self.table = torch.randn(vocab, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def token_features(self, ids):
        return self.table[ids]

    def feature_span(self):
        return None  # a random table's features take every direction


def fake(tr: TokenInput, tokens: int, seed: int = 0) -> Capture:
    g = torch.Generator().manual_seed(seed)
    G = tr.geometry
    x = torch.randn(G.source_layers, G.source_kv_heads, tokens, G.source_head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(G.source_layers, G.source_kv_heads, tokens, G.source_head_dim, generator=g, dtype=torch.float64)
    tr.layer0 = TableLayer0(tr.d_tok // tr.window)
    return Capture(x, v, x, torch.empty(0), torch.randint(0, 50, (tokens,), generator=g))


@pytest.mark.parametrize("base,window", [("crosshead", 1), ("headwise", 2), ("crosslayer", 1)])
def test_closed_form_matches_lstsq_on_source_and_token_features(base, window):
    settings = {"k": 2, "rank": 0, "pairing": "proportional"} if base == "crosslayer" else {}
    tr = TokenInput(GEOM, base={"family": base, "settings": settings}, rank=0, window=window)
    cap = fake(tr, 240)
    L, B, d_in, d_out = tr.fit_blocks()
    x = tr.design(1, cap).double()  # [L, B, T, d_src + d_tok]: the values' design (keys need a bound key space)
    t = tr.features(cap).double()
    if window == 2:  # the previous token's features follow each token's own, zeros before the first
        d = t.shape[1] // 2
        assert torch.equal(t[1:, d:], t[:-1, :d]) and not t[0, d:].any()
    gen = torch.Generator().manual_seed(1)
    ne, ys = NormalEquations(L, B, d_in, d_out), []
    for which in (0, 1):
        y = x @ torch.randn(L, B, d_in, d_out, generator=gen, dtype=torch.float64) + 0.3
        y = y + 0.05 * torch.randn(y.shape, generator=gen, dtype=torch.float64)
        ne.update(which, x, y)
        ys.append(y)
    tr.solve_from(ne, 0.0)
    ref = lstsq_blocks(x, ys[1])  # [L, B, d_in + 1, d_out]
    pred_ref = torch.einsum("lbtd,lbdo->lbto", torch.cat([x, torch.ones_like(x[..., :1])], -1), ref)
    c32 = Capture(cap.keys.float(), cap.values.float(), cap.prenorm.float(), cap.logits, cap.ids)
    got = tr.block_targets(tr.map(1, c32, slice(None)).double())
    assert ((got - pred_ref).norm() / pred_ref.norm()).item() < 1e-5
    # with the token maps at zero the family is its base, bit for bit
    with torch.no_grad():
        tr.tok_weight.zero_()
    assert torch.equal(tr.map(1, c32, slice(None)), tr.base.map(1, c32, slice(None)))


def test_shared_low_rank_recovers_a_planted_relation_and_is_priced():
    tr = TokenInput(GEOM, base={"family": "crosshead", "settings": {}}, rank=2)
    cap = fake(tr, 400, seed=2)
    L, B, d_in, d_out = tr.fit_blocks()
    x = tr.design(1, cap).double()
    d_src = d_in - tr.d_tok
    g = torch.Generator().manual_seed(3)
    P = torch.randn(tr.d_tok, 2, generator=g, dtype=torch.float64)
    M = torch.stack([P @ torch.randn(2, d_out, generator=g, dtype=torch.float64) for _ in range(L)])  # rank 2, shared P
    Wb = torch.randn(L, d_src, d_out, generator=g, dtype=torch.float64)
    y = (torch.einsum("ltd,ldo->lto", x[:, 0, :, :d_src], Wb) + torch.einsum("ltd,ldo->lto", x[:, 0, :, d_src:], M))[
        :, None
    ]
    ne = NormalEquations(L, B, d_in, d_out)
    for which in (0, 1):
        ne.update(which, x, y + 0.001 * torch.randn(y.shape, generator=g, dtype=torch.float64))
    tr.solve_from(ne, 0.0)
    got = torch.einsum("dr,lro->ldo", tr.tok_down[1].double(), tr.tok_up[1].double())
    assert ((got - M).norm() / M.norm()).item() < 1e-3
    assert ((tr.base.weight[1].double() - Wb).norm() / Wb.norm()).item() < 1e-3
    assert tr.flops_per_token() == tr.base.flops_per_token() + 2.0 * 2 * (tr.d_tok * 2 + L * 2 * d_out)


def test_features_are_the_targets_layer0_and_the_family_trains_and_round_trips(tiny_pair_paths, tmp_path):
    from transformers import AutoTokenizer

    pair = load_tiny_pair(tiny_pair_paths)
    tok = AutoTokenizer.from_pretrained(tiny_pair_paths[0])
    rows = chat_rows(tok, 12, 0, "r")
    tr = TokenInput(
        Geometry.of(pair.source, pair.target), base={"family": "headwise", "settings": {}}, rank=0, window=2
    )
    tr.bind(pair.source, pair.target)
    ids = torch.tensor([rows[0]["prefix_ids"]])
    with torch.no_grad():
        cap = capture(pair.source, ids, want_prenorm=True, logits_to_keep=1)
        own = capture(pair.target, ids, want_prenorm=True, logits_to_keep=1)
    feats = tr.features(cap)  # [T, 2 · (k, v) of layer 0]
    kvw = tr.d_tok // 4
    assert torch.equal(feats[:, :kvw], own.prenorm[0].transpose(0, 1).reshape(-1, kvw))
    assert torch.equal(feats[:, kvw : 2 * kvw], own.values[0].transpose(0, 1).reshape(-1, kvw))
    stats = fit_closed_form(pair.source, pair.target, tr, rows, ridge=0.0)
    assert stats["n_tokens"] > 0
    loss = distill_loss(pair.source, pair.target, tr, rows[1], torch.float32)
    loss.backward()
    assert tr.tok_weight.grad.abs().sum() > 0 and tr.base.weight.grad.abs().sum() > 0
    save_translator(tmp_path / "tr", tr, {"direction": pair.direction, "models": pair.identities()})
    loaded, info = load_translator(tmp_path / "tr", pair)
    assert info["family"] == "tokeninput" and info["settings"]["window"] == 2
    with torch.no_grad():
        a, b = tr(cap), loaded(cap)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(TranslatorError, match="captured token ids"):
        loaded(Capture(cap.keys, cap.values, cap.prenorm, cap.logits))
    with pytest.raises(TranslatorError, match="linear base family"):
        TokenInput(tr.geometry, base={"family": "residual", "settings": {}})
    assert isinstance(loaded.layer0, ContextFree)


TOKEN_GEOM = Geometry(4, 2, 8, 4, 2, 8)
SETTINGS = [("both", 0), ("values", 0), ("keys", 0), ("both", 2)]


class Table:
    """Token features from a fixed random table (a stand-in for the target's layer 0)."""

    def __init__(self, d: int):
        self.table = torch.randn(50, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def token_features(self, ids):
        return self.table[ids]

    def feature_span(self):
        return None  # a random table's features take every direction


@pytest.mark.parametrize("parts,layers", SETTINGS)
def test_each_token_setting_recovers_a_planted_relation_and_is_priced(parts, layers):
    tr = TokenInput(
        TOKEN_GEOM,
        base={"family": "headwise", "settings": {}},
        rank=0,
        window=1,
        token_parts=parts,
        token_layers=layers,
    )
    tr.layer0 = Table(tr.d_tok)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 300, 8, generator=g, dtype=torch.float64)
    cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (300,), generator=g))
    L, B, d_in, d_out = tr.fit_blocks()
    design = tr.design(Part.VALUES, cap).double()  # [L, B, T, d_src + d_tok] (keys need a bound key space)
    W = torch.randn(L, B, 8, d_out, generator=g, dtype=torch.float64)
    M = torch.randn(L, B, tr.d_tok, d_out, generator=g, dtype=torch.float64)
    ne, truth = NormalEquations(L, B, d_in, d_out), {}
    for part in (Part.KEYS, Part.VALUES):
        y = design[..., :8] @ W + 0.2
        for layer in range(L):  # a token term only where the family puts one
            if part in tr.tok_parts and layer < tr.n_tok_layers:
                y[layer] += design[layer, ..., 8:] @ M[layer]
        ne.update(part, design, y)
        truth[part] = y
    tr.solve_from(ne, 0.0)
    c32 = Capture(x.float(), x.float(), x.float(), torch.empty(0), cap.ids)
    whole = tr.map(Part.VALUES, c32, slice(None))
    got = tr.block_targets(whole.double())
    assert ((got - truth[Part.VALUES]).norm() / truth[Part.VALUES].norm()).item() < 1e-5
    assert torch.equal(torch.cat([tr.map(Part.VALUES, c32, slice(i, i + 1)) for i in range(4)]), whole)
    per_part = 2.0 * tr.n_tok_layers * tr.d_tok * tr.d_out  # full rank: each part that reads the features
    base = tr.base.flops_per_token(Part.VALUES)
    assert tr.flops_per_token(Part.VALUES) == base + per_part * (Part.VALUES in tr.tok_parts)
    assert tr.flops_per_token() == tr.flops_per_token(Part.KEYS) + tr.flops_per_token(Part.VALUES)


def test_the_shared_down_projection_is_taken_once_per_capture_and_changes_no_bit():
    """At a rank, every layer's token term reads the same t P. Without gradients it is computed once per capture,
    part and dtype (the engine translates a CPU's long context one layer per chunk), the same bits as per chunk;
    new ids or changed maps compute it again; with gradients it is taken afresh (a training step's graph)."""
    tr = TokenInput(TOKEN_GEOM, base={"family": "headwise", "settings": {}}, rank=3, window=2)
    tr.layer0 = Table(tr.d_tok // 2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in tr.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(4, 2, 60, 8, generator=g)
    cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (60,), generator=g))
    with torch.no_grad():
        per_layer = torch.cat([tr.map(Part.VALUES, cap, slice(i, i + 1)) for i in range(4)])
        (key,) = tr._down
        tr._down.clear()
        whole = tr.map(Part.VALUES, cap, slice(None))
        assert torch.equal(per_layer, whole)
        ids, version, down = tr._down[key]
        tr._down[key] = (ids, version, torch.zeros_like(down))  # a stale entry would show: the base alone
        assert torch.equal(tr.map(Part.VALUES, cap, slice(None)), tr.base.map(Part.VALUES, cap, slice(None)))
        again = Capture(x, x, x, torch.empty(0), cap.ids.clone())  # other ids (equal values): computed again
        assert torch.equal(tr.map(Part.VALUES, again, slice(None)), whole)
        tr.tok_down.mul_(2.0)  # changed maps: computed again
        assert not torch.equal(tr.map(Part.VALUES, again, slice(None)), whole)
    tr.map(Part.VALUES, again, slice(None)).sum().backward()
    assert tr.tok_down.grad is not None and tr.tok_down.grad[Part.VALUES].abs().sum() > 0


@pytest.mark.parametrize("window,tokens", [(3, 60), (2, 1), (3, 2)])
def test_the_fast_down_projection_sums_the_windows_blocks_without_concatenating(window, tokens):
    """Below FP32 (the engine's `fast` paths), t P is taken as Σ_s shift_s(t_own P_s): one matmul of the own
    features against the window's blocks side by side, then the shifted adds. The identity itself, in FP64 against
    the concatenated features' product (to 1e-12, for contexts shorter than the window too); in BF16, within four
    BF16 roundings of the product of the magnitudes (inputs, each block's output, the sum)."""
    tr = TokenInput(TOKEN_GEOM, base={"family": "headwise", "settings": {}}, rank=3, window=window)
    tr.layer0 = Table(tr.d_tok // window)
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in tr.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(4, 2, tokens, 8, generator=g)
    cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (tokens,), generator=g))
    with torch.no_grad():
        want = tr.features(cap).double() @ tr.tok_down[Part.VALUES].double()
        tr._compute = torch.float64
        got = tr.down_projection(Part.VALUES, cap)
        assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=0, atol=1e-12)
        tr._compute = torch.bfloat16
        low = tr.down_projection(Part.VALUES, cap).double()
        bound = 2.0**-6 * (tr.features(cap).abs() @ tr.tok_down[Part.VALUES].abs()).double()
        assert ((low - want).abs() <= bound + 1e-6).all()
    tr._compute = torch.float32
    assert torch.equal(tr.layer0_projections(cap)[0], tr.features(cap)[:, : tr.d_tok // window // 2])


class CacheKeys:
    """Stands in for a bound key space: the captured keys as they are."""

    def source_keys(self, cap, layers, dtype, fused=False):
        return cap.keys[layers].to(dtype)


@pytest.mark.parametrize(
    "base,rank,parts,layers",
    [
        ("headwise", 3, "both", 0),
        ("headwise", 0, "keys", 2),
        ("crosshead", 3, "values", 0),
        ("crosslayer", 3, "both", 3),
        ("headwise", 3, "both", -2),  # chosen layers (token choice fit): layers 1 and 3
        ("headwise", 0, "keys", -1),  # chosen: layer 2
        ("crosshead", 3, "both", 11),  # the last layer (token choice last)
    ],
)
def test_map_into_writes_the_same_bits_as_map_into_a_cache_layout(base, rank, parts, layers):
    """The engine's path (`map_into`: the base's maps written into the output, then the token term added in place)
    against `map` (the sum taken as a new tensor), bit for bit, into a strided slice of a cache-shaped buffer; and
    into a token-major one (`map_into_via`: the token term straight in where it covers the chunk). Chosen layers
    (a negative `layers`: -2 chooses layers 1 and 3, -1 layer 2; 10 + N: the last N) cut every chunk."""
    settings = {"k": 2, "rank": 0, "pairing": "proportional"} if base == "crosslayer" else {}
    tr = TokenInput(
        TOKEN_GEOM,
        base={"family": base, "settings": settings},
        rank=rank,
        window=2,
        token_parts=parts,
        token_layers=abs(layers) % 10,
        token_choice="fit" if layers < 0 else "last" if layers >= 10 else "first",
    )
    if layers < 0:
        tr.token_layer_index.copy_(torch.tensor([1, 3] if layers == -2 else [2]))
    tr.layer0 = Table(tr.d_tok // 2)
    tr.space = tr.base.space = CacheKeys()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in tr.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(4, 2, 40, 8, generator=g)
        cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (40,), generator=g))
        for part in (Part.KEYS, Part.VALUES):
            for chunk in (slice(None), slice(1, 3), slice(3, 4)):
                want = tr.map(part, cap, chunk)
                cache = torch.full((4, 2, 48, 8), float("nan"))  # a cache longer than the context
                out = cache[chunk, :, :40]
                tr.map_into(part, cap, chunk, out)
                assert torch.equal(out, want), (part, chunk)
                assert torch.isnan(cache[chunk, :, 40:]).all()  # nothing written past the context
                token_major = torch.full((4, 40, 2, 8), float("nan"))  # an engine's cache: [layers, tokens, heads, d]
                out = token_major[chunk].transpose(1, 2)
                tr.map_into_via(part, cap, chunk, out, torch.empty(out.shape))
                assert torch.equal(out, want), (part, chunk, "token-major")


@pytest.mark.parametrize("base", ["headwise", "crosslayer", "crosshead"])
def test_the_bf16_fast_path_runs_the_token_term_in_bf16_within_the_engines_tolerance(models, base):
    """Under `fast` into a BF16 cache, the base's maps and the token term's matmuls run in BF16 (every base has a
    fast path): every layer within FAST_BF16_TOLERANCE of the FP32 maths, nothing written past the context."""
    from refs import random_ids

    from kvlingo.core import engine
    from kvlingo.core.engine import FAST_BF16_TOLERANCE

    source, target = models["large", torch.bfloat16], models["small", torch.bfloat16]
    settings = {"k": 2, "rank": 4, "pairing": "proportional"} if base == "crosslayer" else {}
    tr = TokenInput(Geometry.of(source, target), "cache", base={"family": base, "settings": settings}, rank=3)
    tr.bind(source, target)
    g = torch.Generator().manual_seed(11)
    ids = random_ids(40, target.config.vocab_size, 5)
    with torch.no_grad():
        for p in tr.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
        cap = capture(source, ids)
        exact = tr(cap, torch.bfloat16, precision="fp32")
        cache = [torch.full((*c.shape[:2], 48, c.shape[3]), float("nan"), dtype=torch.bfloat16) for c in exact]
        fast = tr(cap, out=tuple(c[:, :, :40] for c in cache), precision="fast")
    assert tr.fast_paths and engine.compute_dtype(tr, torch.bfloat16, "fast") == torch.bfloat16
    assert tr._compute == tr.base._compute == torch.float32  # both back to FP32 after the translation
    assert {dtype for _, dtype in tr._down} == {torch.float32, torch.bfloat16}  # t P taken in each compute dtype
    for ref, got, c in zip(exact, fast, cache):
        assert torch.isnan(c[:, :, 40:]).all()  # nothing written past the context
        assert not torch.equal(ref, got)  # the BF16 matmuls really ran
        for layer in range(ref.shape[0]):
            bound = FAST_BF16_TOLERANCE * ref[layer].float().abs().max().item()
            assert (got[layer].float() - ref[layer].float()).abs().max().item() <= bound


def test_token_features_of_lower_rank_than_their_width_carry_no_rounding_weights():
    """A target whose layer-0 k and v projections are wider than its hidden size (2 · KV width 32 > hidden 16, as
    Qwen3-0.6B's 2,048 > 1,024 and the deep toy pair's small model): its token features span 16 of their 32
    directions per token, FP32 rounding the rest. The closed form solves on their span (from layer 0's weights): the
    token maps stay of the size of the base's, and the BF16 fast path stays within the engine's tolerance of the
    FP32 maths, where maps fitted on rounding would be far outside it."""
    from refs import random_ids
    from tinypair import tiny_model

    from kvlingo.core.engine import FAST_BF16_TOLERANCE

    source = tiny_model("qwen3", "default", seed=1)
    target = tiny_model("qwen3", "default", seed=2, hidden=16, heads=2, kv_heads=2, head_dim=8)
    g = Geometry.of(source, target)
    assert 2 * g.target_kv_heads * g.target_head_dim > target.config.hidden_size
    tr = TokenInput(g, "cache", base={"family": "headwise", "settings": {}}).bind(source, target)
    span = tr.feature_span()  # the window's three places, each the 16 directions of [W_k; W_v] in 32
    assert span.shape == (96, 48) and torch.allclose(span.T @ span, torch.eye(48, dtype=torch.float64))
    with torch.no_grad():
        t = tr.layer0.token_features(random_ids(40, 320, 7)).double()  # [tokens, 32]
    assert (t - t @ span[:32, :16] @ span[:32, :16].T).abs().max() < 1e-5 * t.abs().max()  # they lie in it
    rows = [
        {"prefix_ids": random_ids(40, 320, s)[0].tolist(), "reply_ids": random_ids(8, 320, 50 + s)[0].tolist()}
        for s in range(24)
    ]
    fit_closed_form(source, target, tr, rows, "uniform", 0.0)
    base = tr.base.weight.abs().max().item()
    assert tr.tok_down.abs().max().item() < 100 * max(1.0, base), (tr.tok_down.abs().max().item(), base)
    with torch.no_grad():
        cap = capture(source, random_ids(40, 320, 99))
        exact = tr(cap, torch.bfloat16, precision="fp32")
        fast = tr(cap, torch.bfloat16, precision="fast")
    for ref, got in zip(exact, fast):
        for layer in range(ref.shape[0]):
            bound = FAST_BF16_TOLERANCE * ref[layer].float().abs().max().item()
            assert (got[layer].float() - ref[layer].float()).abs().max().item() <= bound, layer


def test_chosen_layers_are_those_whose_held_out_error_the_features_lower_and_only_they_read_them():
    """Token choice fit on a planted relation: the token features reach the target at layers 1 and 3 only (of 4).
    `choose_from` picks those two on held-out conversations (fit on others), the solve recovers the relation with
    no token term elsewhere, each chunk's map is the whole map's rows, the pricing counts two layers, and the
    choice survives a save and load."""
    tr = TokenInput(
        TOKEN_GEOM,
        base={"family": "headwise", "settings": {}},
        rank=0,
        window=1,
        token_layers=2,
        token_choice="fit",
    )
    tr.layer0 = Table(tr.d_tok)
    L, B, d_in, d_out = tr.fit_blocks()
    g = torch.Generator().manual_seed(3)
    W = torch.randn(L, B, 8, d_out, generator=g, dtype=torch.float64)
    M = torch.randn(L, B, tr.d_tok, d_out, generator=g, dtype=torch.float64)
    sets = []
    for n in (400, 100):  # fit, held out
        x = torch.randn(4, 2, n, 8, generator=g, dtype=torch.float64)
        cap = Capture(x, x, x, torch.empty(0), torch.randint(0, 50, (n,), generator=g))
        tr._memo = tr._own = None
        design = tr.design(Part.VALUES, cap).double()
        ne = NormalEquations(L, B, d_in, d_out)
        for part in (Part.KEYS, Part.VALUES):
            y = design[..., :8] @ W + 0.05 * torch.randn(L, B, n, d_out, generator=g, dtype=torch.float64)
            y[1] += design[1, ..., 8:] @ M[1]
            y[3] += 0.3 * design[3, ..., 8:] @ M[3]  # a weaker term: still above layers 0 and 2's none
            ne.update(part, design, y)
        sets.append((ne, cap, y))
    skipping = tr.choose_from(sets[0][0], sets[1][0], 0.0, native_layers=(1,))  # layer 1 the target's own
    assert 3 in skipping["chosen"] and 1 not in skipping["chosen"]
    assert skipping["native_layers"] == [1] and 1 not in tr.chosen_layers()
    choice = tr.choose_from(sets[0][0], sets[1][0], 0.0)
    assert choice["chosen"] == [1, 3] and tr.chosen_layers() == [1, 3]
    share = choice["held_out_share_removed"]
    assert min(share[1], share[3]) > 0.5 > max(share[0], share[2])  # the planted layers, against noise
    with pytest.raises(TranslatorError, match="--ridge auto"):
        tr.choose_from(sets[0][0], None, 0.0)
    with pytest.raises(TranslatorError, match="give --token-layers 1 or fewer"):
        tr.choose_from(sets[0][0], sets[1][0], 0.0, native_layers=(0, 1, 2))
    tr.solve_from(sets[0][0].merged(sets[1][0]), 0.0)
    x = sets[1][1].keys.float()
    c32 = Capture(x, x, x, torch.empty(0), sets[1][1].ids)
    tr._memo = tr._own = None
    whole = tr.map(Part.VALUES, c32, slice(None))
    got, truth = tr.block_targets(whole.double()), sets[1][2]
    assert ((got - truth).norm() / truth.norm()).item() < 0.02  # noise 0.05 against unit-scale targets
    assert torch.equal(torch.cat([tr.map(Part.VALUES, c32, slice(i, i + 1)) for i in range(4)]), whole)
    assert torch.equal(tr.tok_weight[Part.VALUES].abs().sum((1, 2)) > 0, torch.tensor([True, True]))
    assert tr.flops_per_token(Part.VALUES) == tr.base.flops_per_token(Part.VALUES) + 2.0 * 2 * tr.d_tok * tr.d_out
    again = TokenInput.from_spec(TOKEN_GEOM, tr.key_space, tr.settings())
    again.load_state_dict(tr.state_dict(), strict=True)
    again.layer0 = tr.layer0
    assert again.chosen_layers() == [1, 3] and torch.equal(again.map(Part.VALUES, c32, slice(None)), whole)


def test_a_token_choice_is_refused_with_its_fix():
    with pytest.raises(TranslatorError, match="--token-layers N, 1 to 3"):
        TokenInput(TOKEN_GEOM, token_layers=0, token_choice="fit")
    with pytest.raises(TranslatorError, match="first, last, fit"):
        TokenInput(TOKEN_GEOM, token_layers=2, token_choice="best")
    with pytest.raises(TranslatorError, match="token choice last picks N"):
        TokenInput(TOKEN_GEOM, token_layers=4, token_choice="last")
    last = TokenInput(TOKEN_GEOM, token_layers=3, token_choice="last")
    assert last.chosen_layers() == [1, 2, 3] and last.choose_from(None, None, 0.0) is None  # nothing to choose


def test_a_handoff_that_takes_layers_from_the_target_prices_only_the_token_maps_it_still_runs():
    """`flops_per_token_without` (what the ablation and `refresh_flops` charge): the head-wise base loses the own
    layers' maps; the token term keeps its down-projection and loses an up-projection per own layer among the token
    layers: the first 2 lose layer 0's under exact:0, the last 2 lose none, and a closed-form choice (which never
    takes an own layer) none, before and after it chooses."""
    from kvlingo.core.refresh import refresh_flops
    from kvlingo.core.settings import Refresh

    def make(choice: str) -> TokenInput:
        return TokenInput(
            TOKEN_GEOM, base={"family": "headwise", "settings": {}}, rank=4, token_layers=2, token_choice=choice
        )

    first, last, fit = make("first"), make("last"), make("fit")
    base = first.base.flops_per_token()
    up = 2.0 * 4 * first.d_out  # one layer's up-projection of keys or values
    assert first.flops_per_token() == base + 2 * (2.0 * first.d_tok * 4 + 2 * up)
    assert first.flops_per_token_without(()) == first.flops_per_token()
    assert first.flops_per_token_without((0,)) == base * 3 / 4 + 2 * (2.0 * first.d_tok * 4 + up)
    assert (
        last.flops_per_token_without((0,))
        == fit.flops_per_token_without((0,))
        == base * 3 / 4 + 2 * (2.0 * first.d_tok * 4 + 2 * up)
    )
    assert first.flops_per_token_without((0, 1)) == base / 2  # no token layer left: no down-projection either
    # refresh_flops charges the same, and prices a family of equal layers from its FLOPs per token as before
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=4,
        intermediate_size=128,
        vocab_size=100,
    )
    exact = Refresh.parse("exact:0")
    assert refresh_flops(exact, cfg, cfg, first, 10)["translate_flops"] == first.flops_per_token_without((0,)) * 10
    head = first.base
    assert refresh_flops(exact, cfg, cfg, head, 10) == refresh_flops(exact, cfg, cfg, head.flops_per_token(), 10)


def test_the_closed_form_chooses_the_layers_on_held_out_conversations_and_the_folder_keeps_them(
    tiny_pair_paths, tmp_path
):
    """Through `fit_closed_form` with --ridge auto on the tiny pair: the choice is recorded in the fit's statistics
    (each layer's held-out share and the layers chosen), the maps read the features at those layers, and a saved
    translator loads with the same choice and bits. Without held-out conversations (a numeric ridge) it is refused
    before any conversation is read."""
    from transformers import AutoTokenizer

    pair = load_tiny_pair(tiny_pair_paths)
    rows = chat_rows(AutoTokenizer.from_pretrained(tiny_pair_paths[0]), 12, 0, "r")
    geometry = Geometry.of(pair.source, pair.target)
    n = geometry.target_layers - 1  # every layer but the target's own layer 0
    tr = TokenInput(geometry, rank=0, window=2, token_layers=n, token_choice="fit").bind(pair.source, pair.target)
    stats = fit_closed_form(pair.source, pair.target, tr, rows, ridge="auto", native_layers=(0,))  # as under exact:0
    choice = stats["layer_choice"]
    assert len(choice["held_out_share_removed"]) == geometry.target_layers and choice["held_out_tokens"] > 0
    share = torch.tensor(choice["held_out_share_removed"])
    share[0] = -1.0  # the target's own layer 0 is never chosen
    assert choice["chosen"] == sorted(share.topk(n).indices.tolist()) == tr.chosen_layers()
    assert choice["native_layers"] == [0] and 0 not in choice["chosen"]
    assert tr.tok_weight.abs().sum() > 0
    save_translator(tmp_path / "tr", tr, {"direction": pair.direction, "models": pair.identities()})
    loaded, info = load_translator(tmp_path / "tr", pair)
    assert info["settings"]["token_choice"] == "fit" and loaded.chosen_layers() == tr.chosen_layers()
    ids = torch.tensor([rows[0]["prefix_ids"]])
    with torch.no_grad():
        cap = capture(pair.source, ids, want_prenorm=True, logits_to_keep=1)
        a, b = tr(cap), loaded(cap)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    fresh = TokenInput(geometry, rank=0, window=2, token_layers=n, token_choice="fit").bind(pair.source, pair.target)
    with pytest.raises(TranslatorError, match="--ridge auto"):
        fit_closed_form(pair.source, pair.target, fresh, rows, ridge=0.0)
    with pytest.raises(TranslatorError, match="--ridge auto"):  # before any work: no conversation is read
        fit_closed_form(pair.source, pair.target, fresh, [{"no": "conversation"}], ridge=0.0)
