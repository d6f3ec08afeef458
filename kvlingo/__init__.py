"""KVLRelay: translate one model's KV cache into another's, and measure what it costs and saves.

    kvlingo.core   the maths of a handoff: capture and injection, RoPE, key spaces, the translator
                   interface and its families, the FP64 fit, KL, the handoff path itself
    kvlingo.train  the closed-form fit over data, distillation, checkpoints, frozen-model checks
    kvlingo.eval   quality arms, native controls, timing and speed at real shapes, tasks, statistics
    kvlingo.run    the pair and its config, run folders, profiles, reports, resume keys, data, the recipe
    kvlingo.toy    the offline toy world (a fixture: no real run imports it)
    kvlingo.io     atomic writes and hashes

The stage scripts at the top of the repository own the loops and the files; this package owns the maths.
"""
