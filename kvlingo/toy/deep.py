"""The deep toy pair: two toy Qwen3 models of Qwen3-1.7B's and Qwen3-0.6B's depth (28 layers each).

    large  28 layers, hidden 128, 4 query heads × 2 KV heads × head_dim 32, MLP 384, rope_theta 10,000
    small  28 layers, hidden  64, 4 query heads × 2 KV heads × head_dim 32, MLP 192, rope_theta 50,000

The pair is related as the real one is: the same depth and KV width, the large twice the small's
hidden size, fewer KV heads than query heads (the small's query width twice its hidden size, as
Qwen3-0.6B's is), MLPs three times the hidden size. The packaged 4-layer pair (kvlingo/toy/train.py)
has the same widths ratio at 4 layers, where a target's exact layer 0 is a quarter of its cache; here
it is 1/28, as in the real pair. The rope bases differ, as the packaged pair's do, so a translator has
to strip one schedule and apply the other.

Both models train on the packaged world's corpus (seed 0, the same generator and tokenizer) plus
single-turn multiple-choice chats in the toy ARC's own format and option drills (chats asking which
letter an option has, `kvlingo.toy.mismatched.drill_items`), none of them an evaluation item. Their
multiple-choice replies take the `stopped` form (`stopped_reply`): the fact, the answer's text
respelled after "=", then the options in order, each respelled after its letter, up to the one that
matches, then the answer line:

    Vera lives in Lisbon.
    =Lisbon
    A=Brno
    B=Lisbon
    Answer: B

Deciding where to stop compares the line just written with the first one, two spellings the prompt
does not use (its options read " Lisbon"); the letter is then the current line's. The world's own
reply ("Vera lives in Lisbon.\nAnswer: B") asks for the letter of the option whose text the fact
names, a lookup backwards through the prompt that small models learn slowly or not at all
(docs/results.md, the mismatched model's recipe).

Training: one CPU thread, bf16 autocast (the packaged pair's setting), AdamW with warm-up and cosine
decay for a fixed step count per model, so a seed gives the same weights on one machine; checkpoints
every 200 steps, so a killed build resumes to the same weights (`train.train_model`). The weights are
rounded to BF16 before scoring and stored as BF16 shards of at most 4 MB.

Layout: WORLD/deep/{large,small}/ (save_pretrained folders with meta.json) and WORLD/deep/manifest.json,
written last: the build key (config, code and the world's tokenizer and corpus), each model's step
count, loss and scores (exact replies as the packaged pair's manifest records them; greedy toy ARC,
GSM8K and IFEval-file accuracy with n and SE), and the sha256 of every file. `export_deep` copies a
build into kvlingo/toy/deep; `install_deep` copies the packaged one into a toy world after checking
its files and that the world's tokenizer and corpus are the ones it was trained on.
"""

from __future__ import annotations

import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..io import atomic_write_json, read_json, read_jsonl, sha256_file, sha256_json, sha256_tree
from ..records.report import Report
from . import mismatched
from . import train as toytrain
from . import world as toyworld
from .train import ModelShape

PACKAGED_DEEP = Path(__file__).with_name("deep")  # the committed build: large/, small/, manifest.json
MANIFEST = "manifest.json"
NAMES = ("large", "small")
TRAIN_HINT = (
    "retrain and re-export the deep pair with `make toy-train-deep` "
    "(python toy_world.py --out artifacts/toy --train-deep --export-deep kvlingo/toy/deep)"
)


@dataclass(frozen=True)
class DeepConfig:
    layers: int = 28  # decoder layers of both models (Qwen3-1.7B and 0.6B have 28)
    kv_heads: int = 2  # KV heads of both models (the packaged pair's)
    head_dim: int = 32  # per-head width of both models (the packaged pair's)
    large: ModelShape = ModelShape(hidden=128, intermediate=384, heads=4, rope_theta=10_000.0)  # cache builder
    small: ModelShape = ModelShape(hidden=64, intermediate=192, heads=4, rope_theta=50_000.0)  # continuer
    fresh_mc: int = 10_000  # single-turn chats in the toy ARC's format (none an arc.jsonl item)
    drills: int = 10_000  # option drills ("Which option is Lisbon?"), in the same reply form
    large_steps: int = 2_600  # optimiser steps of the large model
    small_steps: int = 3_000  # optimiser steps of the small model
    batch: int = 32  # conversations per step
    lr: float = 2e-3  # AdamW peak learning rate (warm-up, cosine decay, weight decay and clip: the pair's)
    autocast_bf16: bool = True  # bf16 matmuls in training (the packaged pair's setting)
    seed: int = 0  # the large model's weights and batch order; the small's is seed + 1
    data_seed: int = 7  # the stream of the extra multiple-choice chats and drills
    threads: int = 1  # torch CPU threads for training and scoring
    n_scored: int = 240  # items of each evaluation file whose greedy answers the manifest scores


def mini_deep_config() -> DeepConfig:
    """Seconds instead of hours, for tests on the mini toy world."""
    return DeepConfig(
        layers=3,
        head_dim=8,
        large=ModelShape(hidden=32, intermediate=64, heads=4, rope_theta=10_000.0),
        small=ModelShape(hidden=16, intermediate=32, heads=4, rope_theta=50_000.0),
        fresh_mc=16,
        drills=16,
        large_steps=6,
        small_steps=6,
        batch=8,
        n_scored=4,
    )


SOURCES = [Path(__file__), Path(mismatched.__file__), *toytrain.SOURCES]


def code_sha() -> str:
    """Hash of the code that determines the pair (the world's, the packaged pair's training and the drills')."""
    return sha256_tree(SOURCES)


# --------------------------------------------------------------------------- data
def stopped_reply(row: dict, fact: str) -> str:
    """The reply to an ARC-format row in the `stopped` form (module docstring): the fact, "=" and the answer's
    distinct words, then each option's after its letter up to the answer's, then "Answer: X"."""
    short, answer = mismatched._short_options(row), row["answerKey"]
    lines = [f"={short[answer]}"]
    for letter, text in short.items():
        lines.append(f"{letter}={text}")
        if letter == answer:
            break
    return toyworld.arc_reply(row, "\n".join([fact, *lines]))


def extra_rows(cfg: DeepConfig, exclude: set) -> list[dict]:
    """`cfg.fresh_mc` single-turn multiple-choice chats and `cfg.drills` option drills, in the stopped form, on a
    stream of their own; none has the question and option set of an `exclude` key (the toy ARC's rows)."""
    rng = random.Random(f"toydeep-pair/{cfg.data_seed}/fresh-mc")
    rows: list[dict] = []
    while len(rows) < cfg.fresh_mc:
        item = toyworld.make_mc(rng, context=False, max_distractors=0)
        if mismatched.arc_key(item.task) in exclude:
            continue
        fact = item.reply.rsplit("\n", 1)[0]  # arc_reply: the fact, then the answer line
        rows.append(mismatched._single_turn(item.task, stopped_reply(item.task, fact)))
    for drill in mismatched.drill_items(cfg.drills, cfg.data_seed):
        fact = f"It is {mismatched._answer_text(drill)}."
        rows.append(mismatched._single_turn(drill, stopped_reply(drill, fact)))
    return rows


def training_data(tok, world: Path, cfg: DeepConfig, max_len: int) -> list[toytrain.Encoded]:
    """The corpus's training chats (loss on every assistant turn) and the extra chats (loss on the reply)."""
    rows = read_jsonl(world / "corpus" / "train_chats.jsonl")
    arc_rows = read_jsonl(world / "corpus" / "arc.jsonl")
    extra = extra_rows(cfg, {mismatched.arc_key(r) for r in arc_rows})
    data = toytrain.encode_rows(tok, rows) + toytrain.encode_rows(tok, extra, all_assistant_turns=False)
    return [d for d in data if len(d.ids) <= max_len]


# --------------------------------------------------------------------------- scoring
@torch.no_grad()
def greedy_scores(model, tok, world: Path, n: int, max_new_tokens: int = 48) -> dict:
    """Greedy accuracy on the first `n` items of the toy ARC and GSM8K files, as task_eval.py scores the
    native path (its prompts, parsers and the demo's 48-token cap): {task: {n, accuracy, se, unparsed}}."""
    from ..core.handoff import greedy_generate, stop_ids
    from ..eval.stats import mean_se
    from ..eval.tasks.generate import answer_text
    from ..eval.tasks.parsers import score
    from ..eval.tasks.prompts import ITEM_BUILDERS, user_prompt_ids

    eos = stop_ids(tok)
    out = {}
    for task in ("arc", "gsm8k"):
        right, unparsed = [], 0
        for row in read_jsonl(world / "corpus" / f"{task}.jsonl")[:n]:
            item = ITEM_BUILDERS[task](row)
            ids, _ = greedy_generate(
                model,
                user_prompt_ids(tok, item.prompt, enable_thinking=False),
                None,
                max_new_tokens=max_new_tokens,
                eos_ids=eos,
            )
            pred, ok = score(task, item, answer_text(tok, ids))
            right.append(float(ok))
            unparsed += pred is None
        acc = mean_se(right)
        out[task] = {"n": acc["n"], "accuracy": acc["mean"], "se": acc["se"], "unparsed": unparsed / max(n, 1)}
    return out


# --------------------------------------------------------------------------- the build
def _world_inputs(world: Path) -> dict:
    """What the pair is trained on and must be installed beside: the world's tokenizer and corpus hashes."""
    pair = read_json(world / "manifest.json")
    return {
        "tokenizer_sha256": sha256_file(world / "tokenizer" / "tokenizer.json"),
        "corpus_sha256": {rel: sha for rel, sha in sorted(pair["files"].items()) if rel.startswith("corpus/")},
    }


def build_deep(
    world: str | Path,
    cfg: DeepConfig | None = None,
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Train (or verify and keep) WORLD/deep/{large,small} on an installed toy world; return the manifest.

    Each model trains in turn, from its checkpoint when one of the same key is there; a model whose
    folder holds weights of the same key is kept. The manifest is written last."""
    from transformers import AutoTokenizer

    t0 = time.time()
    world = Path(world)
    if not (world / "manifest.json").is_file():
        raise ValueError(f"{world} holds no toy world; install it first (make toy)")
    pair = read_json(world / "manifest.json")
    cfg = cfg or (mini_deep_config() if toytrain.is_mini(pair) else DeepConfig())
    inputs = _world_inputs(world)
    build_key = sha256_json({"config": asdict(cfg), "code": code_sha(), "inputs": inputs})
    out = world / "deep"
    if not force and (out / MANIFEST).is_file():
        old = read_json(out / MANIFEST)
        if old.get("resume_key") == build_key and toytrain._files_ok(out, old.get("files", {})):
            log(f"deep pair at {out} is up to date (build key {build_key[:12]}); nothing to do")
            return old

    pair_cfg = mismatched.pair_config(pair)
    tok = AutoTokenizer.from_pretrained(world / "tokenizer")
    data = training_data(tok, world, cfg, pair_cfg.max_len)
    files = {name: world / "corpus" / f"{name}.jsonl" for name in toyworld.WORLD_FILES}
    sets = toytrain.evaluation_sets(files, pair_cfg)
    log(
        f"deep pair: {len(data)} training sequences ({cfg.fresh_mc} multiple-choice chats and {cfg.drills} drills "
        f"beside the corpus); {cfg.layers} layers, {cfg.kv_heads} KV heads × head_dim {cfg.head_dim}"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # incomplete until the new one is written
    models: dict[str, dict] = {}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        for i, name in enumerate(NAMES):
            shape, steps = (cfg.large, cfg.large_steps) if name == "large" else (cfg.small, cfg.small_steps)
            models[name] = _train_one(
                out,
                name,
                shape,
                steps,
                cfg.seed + i,
                cfg,
                pair_cfg,
                build_key,
                tok,
                data,
                world,
                sets,
                force,
                progress,
                log,
            )
    finally:
        torch.set_num_threads(threads_before)
    rel_files = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    )
    n_samples = {name: {cond: len(r) for cond, r in conds.items()} for name, conds in sets.items()}
    return Report(
        "toy_deep_pair",
        config=cfg,
        inputs={"code_sha256": code_sha(), **inputs},
        results={"models": models, "mini": toytrain.is_mini(pair)},
        n_samples={"exact_reply": n_samples, "greedy_items_per_task": cfg.n_scored},
        seeds={"large": cfg.seed, "small": cfg.seed + 1, "data": cfg.data_seed},
        wall_time_s=time.time() - t0,
        device="cpu",
        dtype="float32",
        resume_key=build_key,
        files={rel: sha256_file(out / rel) for rel in rel_files},
    ).write(out / MANIFEST)


def _train_one(
    out: Path,
    name: str,
    shape: ModelShape,
    steps: int,
    seed: int,
    cfg: DeepConfig,
    pair_cfg,
    build_key: str,
    tok,
    data,
    world: Path,
    sets: dict,
    force: bool,
    progress: bool,
    log,
) -> dict:
    """Train (or keep) one model of the pair and score it; its meta.json holds what the manifest reports."""
    train_cfg = replace(
        pair_cfg,
        layers=cfg.layers,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        batch=cfg.batch,
        lr=cfg.lr,
        autocast_bf16=cfg.autocast_bf16,
    )
    qcfg = toytrain.qwen3_config(train_cfg, shape, tok)
    model_key = sha256_json({"build_key": build_key, "name": name, "steps": steps, "seed": seed})
    path = out / name
    meta = read_json(path / "meta.json") if (path / "meta.json").is_file() else {}
    if (
        not force
        and meta.get("model_key") == model_key
        and any(path.glob("*.safetensors"))
        and toytrain.local_weights_digest(path) == meta.get("weights_sha256")
    ):
        log(f"deep {name}: keeping its trained weights ({meta['train_steps']} steps)")
    else:
        log(
            f"deep {name}: training {steps} steps (hidden {shape.hidden}, {shape.heads} query heads, "
            f"{cfg.layers} layers, rope_theta {shape.rope_theta:g})"
        )
        ckpt = out / f".{name}.ckpt.pt"
        t1 = time.time()
        model, loss_log = toytrain.train_model(
            qcfg,
            data,
            steps,
            train_cfg,
            seed,
            tok.pad_token_id,
            desc=f"deep {name}",
            progress=progress,
            checkpoint=ckpt,
            checkpoint_key=model_key,
        )
        train_s = time.time() - t1
        toytrain.round_to_bf16(model)  # scored exactly as stored
        t2 = time.time()
        exact = toytrain.score_model(model, tok, sets)
        greedy = greedy_scores(model, tok, world, cfg.n_scored)
        meta = {
            "model_key": model_key,
            "name": name,
            "train_steps": steps,
            "train_wall_s": train_s,
            "eval_wall_s": time.time() - t2,
            "n_params": sum(p.numel() for p in model.parameters()),
            "threads": torch.get_num_threads(),
            "seed": seed,
            "loss_log": loss_log,
            "exact_reply": exact,
            "greedy": greedy,
            "config": asdict(cfg),
        }
        toytrain._save_model(model, tok, path, meta)
        ckpt.unlink(missing_ok=True)
    info = {k: meta[k] for k in ("train_steps", "train_wall_s", "eval_wall_s", "n_params", "threads", "seed")}
    info["final_loss"] = meta["loss_log"][-1]["loss"] if meta["loss_log"] else None
    info["exact_reply"], info["greedy"] = meta["exact_reply"], meta["greedy"]
    info["qwen3_config"] = {
        k: getattr(qcfg, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rope_parameters",
            "tie_word_embeddings",
            "max_position_embeddings",
        )
    }
    return info


# --------------------------------------------------------------------------- packaging
def _check_files(folder: Path, manifest: dict) -> None:
    bad = [
        rel
        for rel, sha in manifest["files"].items()
        if not (folder / rel).is_file() or sha256_file(folder / rel) != sha
    ]
    if bad:
        raise ValueError(
            f"{folder / bad[0]} differs from the deep pair's manifest ({len(bad)} file(s)); "
            f"restore it (git checkout -- {folder}) or {TRAIN_HINT}"
        )


def export_deep(world: str | Path, dest: str | Path = PACKAGED_DEEP, log: Callable[[str], None] = print) -> dict:
    """Copy a verified full build of WORLD/deep into `dest` (manifest last)."""
    src, dest = Path(world) / "deep", Path(dest)
    manifest = read_json(src / MANIFEST)
    if manifest["results"].get("mini"):
        raise ValueError(f"{src} was built on a mini world; only a full build is exported")
    _check_files(src, manifest)
    tmp = dest.parent / f".{dest.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(MANIFEST, ".*"))
    atomic_write_json(tmp / MANIFEST, manifest)  # last: marks the export complete
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log(f"exported the deep pair of {src} to {dest}")
    return manifest


def install_deep(world: str | Path, packaged: str | Path = PACKAGED_DEEP, log: Callable[[str], None] = print) -> dict:
    """Copy the packaged deep pair into WORLD/deep; return its manifest.

    Refused (ValueError naming the file and the fix, before WORLD/deep is touched) when a packaged file
    differs from its manifest, or the world's tokenizer or corpus is not the one the pair was trained on."""
    world, packaged = Path(world), Path(packaged)
    if not (packaged / MANIFEST).is_file():
        raise ValueError(f"no packaged deep pair at {packaged}; {TRAIN_HINT}")
    manifest = read_json(packaged / MANIFEST)
    out = world / "deep"
    if (out / MANIFEST).is_file() and read_json(out / MANIFEST).get("resume_key") == manifest["resume_key"]:
        try:
            _check_files(out, manifest)
            log(f"deep pair at {out} is up to date (build key {manifest['resume_key'][:12]}); nothing to do")
            return manifest
        except ValueError:
            pass  # damaged: install again
    _check_files(packaged, manifest)
    trained_on = {k: manifest["inputs"][k] for k in ("tokenizer_sha256", "corpus_sha256")}
    here = _world_inputs(world)
    if here != trained_on:
        field = next(k for k in trained_on if here[k] != trained_on[k])
        raise ValueError(
            f"the toy world at {world} has another {field.removesuffix('_sha256')} than the one the deep "
            f"pair was trained on; install the packaged pair there (make toy) or {TRAIN_HINT}"
        )
    tmp = world / ".deep.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(packaged, tmp, ignore=shutil.ignore_patterns(MANIFEST))
    atomic_write_json(tmp / MANIFEST, {**manifest, "installed_from": str(packaged)})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"installed the packaged deep pair into {out} ({len(manifest['files'])} files)")
    return manifest
