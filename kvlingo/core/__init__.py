"""The maths of a handoff: capture and injection, RoPE, key spaces, translator families, the FP64 fit, KL."""
