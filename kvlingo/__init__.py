"""KVLRelay: translate one model's KV cache into another's, and measure what it costs and saves.

    kvlingo.io     atomic writes and hashes; kvlingo.errors: refusals and failures
    kvlingo.core   the maths of a handoff: capture and injection, RoPE, key spaces, the translator
                   interface and its families, the chunked engine, the FP64 fit, KL, the handoff path itself
    kvlingo.run    the foundation: the pair and its config, run folders, profiles, reports, resume keys, data
    kvlingo.train  the closed-form fit over data, distillation, checkpoints, frozen-model checks
    kvlingo.eval   quality arms, native controls, tasks, statistics
    kvlingo.bench  speed: timing the paths, the physical limit, real shapes with random weights
    kvlingo.stages  what the stage scripts share, and cells (the recipe, the ablation, the frontier)
    kvlingo.toy    the offline toy world (a fixture: no real run imports it)
    kvlingo.Relay  the public entry point: load an exported translator and hand chats from one model to the other

Each package imports only the ones above it in this list (kvlingo.Relay: core and run).
The stage scripts at the top of the repository own the loops and the files; this package owns the maths.
"""

__all__ = ["Relay"]


def __getattr__(name: str):
    # Imported on first use, so `import kvlingo` stays free of torch and transformers; through importlib rather
    # than an import statement, so the stages' code hashes (kvlingo.records.resume follows import statements, and
    # every stage imports this package) do not take in an API they never run.
    if name == "Relay":
        import importlib

        return importlib.import_module(".relay", __name__).Relay
    raise AttributeError(f"module 'kvlingo' has no attribute {name!r}")
