"""Serve two models with vLLM and switch a conversation between them through kvlingo's KV connector.

    toy           a conversation whose turns alternate between the toy pair's two models, each served by vLLM
                  on the CPU; at each switch the next model starts from the other's translated cache, and its
                  time to first token is timed against vLLM's own re-prefill of the same prompt
    prepare-real  random Qwen3-1.7B and 0.6B weights saved as model folders (the toy tokenizer), and a random
                  translator exported for them (suite environment): by default the default translator (token-w3:
                  token input over a window of three tokens) with refresh exact:0
    real          time to first token of the 0.6B at a long context: vLLM's re-prefill against the connector
                  (translating the 1.7B engine's cache), trials interleaved

`toy` and `real` run in the serving environment (`make serve-env`: .venv-serve); `prepare-real` in the
suite's .venv. The engines share this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), and with it the store of
source caches (kvlingo/serve/store.py).
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from ..core.families import FAMILIES
from ..core.settings import PRECISIONS, Refresh
from ..errors import Refusal
from ..inputs.argtypes import whole
from ..io import atomic_write_json
from .skeleton import Stage

# vLLM and kvlingo.serve are imported inside the commands only (`serve_module`): the suite's .venv parses these
# flags, and runs prepare-real, without vLLM.

# A word problem and a note, two more notes, then the problem's question: the last turn needs numbers only the first
# turn's context holds, after three switches of model (toy-world style tasks, not a corpus item).
TOY_TURNS = [
    ("large", "Here is a word problem. Ada has 3 boxes with 9 pencils in each box. Tell me about a forest walk."),
    ("small", "Tell me about the village bakery."),
    ("large", "Tell me about a mountain lake."),
    ("small", "Ada finds 9 more pencils. How many pencils does Ada have now?"),
]


class ServeDemo(Stage):
    name = "serve_demo"
    script = "serve_demo.py"
    summary = "Serve two models with vLLM and switch a conversation between them through kvlingo's KV connector."
    examples = (
        ".venv-serve/bin/python serve_demo.py toy --l2s artifacts/serve-l2s/export --s2l artifacts/serve-s2l/export",
        ".venv/bin/python serve_demo.py prepare-real --root artifacts/serve-real",
        ".venv-serve/bin/python serve_demo.py real --root artifacts/serve-real --allow-unproven --trials 5",
    )
    common = False

    @classmethod
    def add_args(cls, p) -> None:
        p.description = __doc__  # the three commands, and where each runs
        sub = p.add_subparsers(dest="command", required=True)
        add_toy_args(sub.add_parser("toy", help="the alternating conversation on the toy pair"))
        add_prepare_args(
            sub.add_parser(
                "prepare-real",
                help="random real-shape model folders and maps (suite environment)",
            )
        )
        add_real_args(sub.add_parser("real", help="TTFT at real shapes (random weights)"))

    def run(self) -> int:
        """The command's exit status (vLLM and kvlingo.serve imported inside it)."""
        if self.args.command != "prepare-real":  # toy and real serve: vLLM, in the serving environment
            from ..extras import optional

            optional("vllm", "serve")
        return {"toy": run_toy, "prepare-real": run_prepare_real, "real": run_real}[self.args.command](self.args)


# --------------------------------------------------------------------------- flags
def add_toy_args(toy) -> None:
    toy.add_argument("--large", default="artifacts/toy/large", help="the large model folder")
    toy.add_argument("--small", default="artifacts/toy/small", help="the small model folder")
    toy.add_argument("--l2s", required=True, help="exported translator large → small (cache key space)")
    toy.add_argument("--s2l", required=True, help="exported translator small → large (cache key space)")
    toy.add_argument("--dtype", default="float32", help="the engines' dtype")
    toy.add_argument("--trials", type=whole(1), default=5, help="timed TTFT trials per path at each switch")
    toy.add_argument("--warmups", type=whole(0), default=1, help="untimed rounds before them")
    toy.add_argument("--max-tokens", type=whole(1), default=48, help="reply length cap")
    toy.add_argument("--allow-unproven", action="store_true", help="waive the evidence gate (timing only)")
    toy.add_argument("--out", default="results/serve", help="folder of demo.json")


def default_translator() -> tuple[str, str, dict]:
    """The pilot profile's l2s default (what `make run` trains on the real pair): its variant's name, its family and
    the variant's option values by dest (the rest are the family's defaults)."""
    from ..core.families import variant
    from ..inputs.profiles import get_profile

    name = get_profile("pilot").family_for("l2s")
    fam, v = variant(name)
    return name, fam.name, dict(v.flags)


DEFAULT_VARIANT, DEFAULT_FAMILY, _ = default_translator()


def add_prepare_args(prep) -> None:
    prep.add_argument("--root", default="artifacts/serve-real", help="folder of large/, small/, export-l2s/")
    prep.add_argument("--tokenizer", default="artifacts/toy/small", help="tokenizer saved with the models")
    prep.add_argument("--dtype", default="bfloat16", help="weights dtype")
    prep.add_argument(
        "--family",
        default=None,
        choices=sorted(FAMILIES),
        help=f"translator family of the random maps, at its own defaults (default: the pilot profile's l2s default "
        f"translator, {DEFAULT_VARIANT} of the {DEFAULT_FAMILY} family)",
    )
    prep.add_argument(
        "--refresh",
        default=None,
        help="the refresh the handoff runs under: none, tail:W or exact:0 (default: exact:0 for a family that reads "
        "the target's layer 0, as the default translator does; none otherwise)",
    )


def add_real_args(real) -> None:
    real.add_argument("--root", default="artifacts/serve-real", help="folder prepare-real wrote")
    real.add_argument(
        "--family",
        default=DEFAULT_FAMILY,
        choices=sorted(FAMILIES),
        help=f"translator family of the random maps (prepare-real's; default: {DEFAULT_FAMILY}, the family of the "
        f"pilot profile's l2s default)",
    )
    real.add_argument("--tokens", type=whole(2), default=4096, help="context length")
    real.add_argument("--dtype", default="bfloat16", help="the engines' dtype")
    real.add_argument("--trials", type=whole(1), default=5, help="timed trials per path")
    real.add_argument("--warmups", type=whole(0), default=1, help="untimed rounds before them")
    real.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="the translation's precision (default: FP32 maths, as kvlingo.Relay translates)",
    )
    real.add_argument(
        "--suspect-trials",
        type=whole(0),
        default=3,
        help="timed calls per suspect of a slower translation inside the engine (0: none)",
    )
    real.add_argument("--kv-gib", type=whole(1), default=2, help="KV cache GiB per engine (VLLM_CPU_KVCACHE_SPACE)")
    real.add_argument("--allow-unproven", action="store_true", help="waive the gate for the random maps (required)")
    real.add_argument("--out", default="results/serve", help="folder of real.json")


# --------------------------------------------------------------------------- the engines
def serve_module(name: str):
    """kvlingo.serve.NAME, imported through importlib: nothing the suite runs imports the serving package
    (tests/serve/test_contract.py), and an import statement here would put it in the code hash of every stage
    that looks the stages up in the registry (kvlingo.records.resume follows import statements)."""
    return importlib.import_module(f"kvlingo.serve.{name}")


def engine_env(kv_gib: int) -> None:
    """vLLM settings read at import: engines in this process (one store), and the KV cache size per engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def provenance() -> dict:
    import torch
    import transformers
    import vllm

    return {
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg(),
        "vllm_cpu_omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def make_engine(
    model: str, export: str | None, dtype: str, max_len: int, allow_unproven: bool = False, precision: str | None = None
):
    from vllm import LLM

    return LLM(
        model=model,
        dtype=dtype,
        max_model_len=max_len,
        seed=0,
        **serve_module("connector").engine_args(export, allow_unproven=allow_unproven, precision=precision),
    )


# --------------------------------------------------------------------------- toy
def run_toy(args) -> int:
    engine_env(1)
    bench, DECISIONS = serve_module("bench"), serve_module("connector").DECISIONS
    t0 = time.time()
    engines = {
        "large": make_engine(args.large, args.s2l, args.dtype, 2048, args.allow_unproven),
        "small": make_engine(args.small, args.l2s, args.dtype, 2048, args.allow_unproven),
    }
    tokenizer = engines["small"].get_tokenizer()
    rows = bench.conversation(engines, tokenizer, TOY_TURNS, args.trials, args.warmups, args.max_tokens, DECISIONS)
    print("\nThe conversation (each switch: the next model starts from the other's translated cache):\n")
    print(bench.switch_table(rows))
    for r in rows:
        if r.get("reason"):
            print(f"turn {r['turn']} ({r['engine']}): prefilled, {r['reason']}")
    print(
        f"\nTTFT: one engine call returning one token, {args.trials} trials per path after {args.warmups} warm-up(s),"
        f" interleaved; speedup = median re-prefill / median connector (range: slowest/fastest pairs)."
    )
    out = {
        "stage": "serve-demo",
        "config": vars(args),
        "env": provenance(),
        "turns": rows,
        "decisions": DECISIONS,
        "wall_s": time.time() - t0,
    }
    atomic_write_json(Path(args.out) / "demo.json", out)
    print(f"wrote {Path(args.out) / 'demo.json'}")
    if not any(r.get("mode") == "translated" for r in rows):
        print(
            "serve_demo: no switch was translated (every reason is above): vLLM prefilled each turn itself, so "
            f"this run shows only the fallback. Retrain {args.l2s} and {args.s2l} until they pass the evidence "
            "gate (make serve-demo's own: remove artifacts/serve-l2s, artifacts/serve-s2l, results/serve-l2s and "
            "results/serve-s2l, then run it again), or pass --allow-unproven (make serve-demo "
            "SERVE_ARGS=--allow-unproven) for a run that waives the gate",
            file=sys.stderr,
        )
        return 1
    return 0


# --------------------------------------------------------------------------- real shapes
def run_prepare_real(args) -> int:
    bench, root = serve_module("bench"), Path(args.root)
    large = bench.random_model_folder("Qwen/Qwen3-1.7B", root / "large", Path(args.tokenizer), args.dtype, seed=1)
    small = bench.random_model_folder("Qwen/Qwen3-0.6B", root / "small", Path(args.tokenizer), args.dtype, seed=2)
    # the default translator's own settings (a variant's window and rank), or a named family at its defaults
    name, family, flags = default_translator() if args.family is None else (args.family, args.family, {})
    refresh = Refresh.parse(args.refresh or ("exact:0" if FAMILIES[family].reads_layer0 else "none"))
    if refresh.kind not in ("none", "tail", "exact"):
        raise Refusal(f"--refresh {refresh}: a KV connector serves none, tail:W and exact:0 only")
    export = bench.random_export(
        large,
        small,
        root / f"export-l2s-{family}",
        "l2s",
        family,
        "cache",
        args.dtype,
        refresh=str(refresh),
        flags=flags,
    )
    print(
        f"random-weight pair {large}, {small}; random {name} maps (cache key space, refresh {refresh}, "
        f"no evidence) {export}"
    )
    return 0


def run_real(args) -> int:
    engine_env(args.kv_gib)
    import torch
    from transformers import AutoTokenizer

    bench, STORE = serve_module("bench"), serve_module("store").STORE
    if not args.allow_unproven:
        raise Refusal(
            "the random maps carry no evidence, so the gate refuses them and every request would be "
            "prefilled; pass --allow-unproven for this timing-only run"
        )
    root = Path(args.root)
    t0 = time.time()
    export = root / f"export-l2s-{args.family}"
    if not (export / "config.json").is_file():
        raise Refusal(f"{export} holds no exported translator: run prepare-real --family {args.family} first")
    refresh = json.loads((export / "config.json").read_text()).get("refresh", "none")
    print(f"timing-only run: the gate is waived (--allow-unproven) for random {args.family} maps {export}")
    g = torch.Generator().manual_seed(0)
    vocab = len(AutoTokenizer.from_pretrained(root / "small"))  # the engines serve the folders' tokenizer
    ids = torch.randint(3, vocab, (args.tokens,), generator=g).tolist()
    suspects = bench.Suspects(args.suspect_trials) if args.suspect_trials else None
    probe = translation_probe(export, root, ids, args) if suspects else None
    if suspects:  # the suspects of a slower translation inside the engine, one by one as the process gains them
        suspects.time("no engine, vLLM not imported", probe["call"])
        import vllm  # noqa: F401

        suspects.time("after vLLM's import", probe["call"])
    source = make_engine(str(root / "large"), None, args.dtype, args.tokens + 64)
    if suspects:
        suspects.time("beside the source engine", probe["call"])
    target = make_engine(str(root / "small"), str(export), args.dtype, args.tokens + 64, True, args.precision)
    if suspects:
        suspects.time("beside both engines", probe["call"])
    t = time.perf_counter()
    bench.first_token(source, ids)  # the source reads the context; its connector saves the cache
    source_s = time.perf_counter() - t
    entry = max(STORE.entries.values(), key=lambda e: e.n)  # the source's cache, the only one stored yet
    saved = entry.n
    timed = real_trials(target, ids, args)
    found = in_engine(suspects, probe, target, entry, ids, args) if suspects else None
    own_cache_trials(target, ids, args, timed)
    env = provenance()
    print_real(timed, args, source_s, saved, env, refresh)
    if suspects:
        print_suspects(suspects, found)
    out = {
        "stage": "serve-real",
        "config": {**vars(args), "refresh": refresh},
        "env": env,
        "source_prefill_s": source_s,
        "ttft_trials": timed["times"],
        "speedup": timed["speed"],
        "loads": timed["loads"],
        "calls": bench.STARTS,
        "decisions": list(serve_module("connector").DECISIONS),  # every request of the run, in order
        "suspects": {"rows": suspects.rows, **found} if suspects else None,
        "wall_s": time.time() - t0,
    }
    name = f"real-{args.family}-{args.precision or 'fp32'}.json"
    atomic_write_json(Path(args.out) / name, out)
    print(f"wrote {Path(args.out) / name}")
    return 0


def translation_probe(export: Path, root: Path, ids: list[int], args) -> dict:
    """The connector's translation outside any engine: the export accepted for the target folder as the connector
    accepts it, called on a random source cache of the context's shape (keys as cached) with the context's ids,
    into token-major results, in the engines' dtype and the run's precision."""
    import torch

    contract = serve_module("contract")
    dtype = getattr(torch, args.dtype)
    accepted = contract.Contract.load(
        export, contract.ServedModel.describe(str(root / "small")), allow_unproven=True, dtype=dtype
    )
    g = accepted.translator.geometry
    gen = torch.Generator().manual_seed(1)
    shape = (g.source_layers, g.source_kv_heads, len(ids), g.source_head_dim)
    keys, values = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")

    def call(keys=keys, values=values):
        return accepted.translate(keys, values, dtype, None, args.precision, token_major=True, ids=ids)

    result = [(g.target_layers, len(ids), g.target_kv_heads, g.target_head_dim)] * 2
    return {"call": call, "dtype": dtype, "result_shapes": result}


def in_engine(suspects, probe: dict, target, entry, ids: list[int], args) -> dict:
    """The last suspects, interleaved round by round: the engine's own translation (its load's translate_s, a
    connector request with the source's saved cache), the same call on that saved cache outside the engine in this
    process, and again under inference mode; then the allocation of the result (`bench.first_touch`). `entry`:
    the source's stored cache, which the engine's loads translate (before the target's own cache is stored)."""
    import torch

    bench, DECISIONS = serve_module("bench"), serve_module("connector").DECISIONS
    keys, values = entry.prefix(len(ids))
    inside, outside, inference = [], [], []
    for r in range(args.suspect_trials + 1):  # the first round is a warm-up
        mark = len(DECISIONS)
        bench.first_token(target, ids, bench.NO_SAVE)
        load = next(d for d in reversed(DECISIONS[mark:]) if d.get("event") == "loaded")
        t = time.perf_counter()
        probe["call"](keys, values)
        out_s = time.perf_counter() - t
        with torch.inference_mode():
            t = time.perf_counter()
            probe["call"](keys, values)
            inf_s = time.perf_counter() - t
        if r:
            inside.append(load["translate_s"])
            outside.append(out_s)
            inference.append(inf_s)
    suspects.add(
        "inside the engine's load (translate_s)",
        inside,
        **{k: load[k] for k in ("threads", "affinity", "inference_mode")},  # the last load's state
    )
    suspects.add("outside it, the engine's saved cache", outside)
    with torch.inference_mode():
        suspects.add("outside it, the same, inference mode", inference)
    alloc = bench.first_touch(probe["result_shapes"], probe["dtype"], args.suspect_trials)
    return {"allocation": alloc}


def print_suspects(suspects, found: dict) -> None:
    """Where the connector's translation time goes: each suspect's row, and the allocation line."""
    a = found["allocation"]
    numa = suspects.rows[0]["numa_nodes"]
    print(
        "\nThe same translation wherever the engine could make it slower (each row a suspect: vLLM's import, a "
        "second engine in the process, the engine's load with its threads, CPU binding and inference mode):\n"
    )
    print(suspects.table())
    print(
        f"\nallocation: the result ({a['bytes'] / 2**20:.0f} MiB) allocated and written fresh "
        f"{a['fresh']['median']:.3f} s against written into touched memory {a['reused']['median']:.3f} s "
        f"({a['cost_s']:+.3f} s per translation); NUMA nodes: {numa}."
    )


def real_trials(target, ids: list[int], args) -> dict:
    """The target engine's TTFT, interleaved: re-prefill against the connector (translating the source's saved
    cache). Returns {times, speed, loads, decisions}."""
    bench, DECISIONS = serve_module("bench"), serve_module("connector").DECISIONS
    mark = len(DECISIONS)
    times = bench.interleaved(
        {
            "reprefill": lambda: bench.first_token(target, ids, bench.OFF),
            "connector": lambda: bench.first_token(target, ids, bench.NO_SAVE),
        },
        args.trials,
        args.warmups,
    )
    loads = [d for d in DECISIONS[mark:] if d.get("event") == "loaded"][args.warmups :]
    speed = bench.ratio(times["reprefill"], times["connector"])
    return {"times": times, "speed": speed, "loads": loads, "decisions": DECISIONS[mark:]}


def own_cache_trials(target, ids: list[int], args, timed: dict) -> None:
    """The connector's floor in this engine, added to `timed`'s times: once the target holds its own cache of the
    context (saved by one ordinary request through the connector), a load writes it back with no translation."""
    bench = serve_module("bench")
    bench.first_token(target, ids)
    timed["times"].update(
        bench.interleaved(
            {"own cache": lambda: bench.first_token(target, ids, bench.NO_SAVE)}, args.trials, args.warmups
        )
    )


def print_real(timed: dict, args, source_s: float, saved: int, env: dict, refresh: str) -> None:
    """The TTFT table (each path, and the connector's translate and write under it) and the speedup line."""
    bench = serve_module("bench")
    loads, speed = timed["loads"], timed["speed"]
    parts = {k: bench.spread([d[k] for d in loads]) for k in ("translate_s", "write_s")} if loads else {}

    def row(path: str, s: dict) -> list:
        return [path, s["n"], f"{s['median']:.3f}", f"{s['min']:.3f}", f"{s['max']:.3f}", f"{s['cv']:.3f}"]

    rows = [row(path, bench.spread(ts)) for path, ts in timed["times"].items()]
    rows[2:2] = [row(f"  └ {k.removesuffix('_s')}", s) for k, s in parts.items()]
    print(
        f"\nQwen3-1.7B → 0.6B shapes (random weights, {args.dtype}), random {args.family} maps (cache key space, "
        f"refresh {refresh}, precision {args.precision or 'fp32'}), {args.tokens}-token context; the source engine "
        f"read it in {source_s:.1f} s and saved {saved} tokens. TTFT of the 0.6B engine, seconds:\n"
    )
    print("| path | n | median | min | max | CV |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print(
        f"\nspeedup (median re-prefill / median connector): {speed['median']:.1f}× (range over trial pairs "
        f"{speed['low']:.1f}–{speed['high']:.1f}×); torch threads in the engine {loads[0]['threads'] if loads else '?'}"
        f", {env['cpus']} CPUs, load average {env['load_average'][0]:.1f} at the end. 'own cache': the same "
        f"context written back with no translation (the connector's floor in this engine)."
    )
