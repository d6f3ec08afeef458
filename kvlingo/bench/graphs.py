"""Replaying a step as one CUDA graph: one launch instead of hundreds.

A 16-token new turn of a 0.6B model on a GPU is bound by kernel launches, not by the GPU, and
a replayed graph gives bit-identical logits. `capture(fn, device)` runs `fn` a few times on a side
stream (so lazy allocations, cuBLAS workspaces and kernel choices settle), captures one more
call, and returns a function that replays it.

What a graph fixes at capture: every shape, every tensor address it reads or writes, and
Python's decisions (`fn` itself never runs again). So `fn` must read its inputs from and
write its outputs to tensors that outlive the graph (a preallocated cache, a stored capture),
and its return value is a tensor the graph overwrites on every replay. Off CUDA there is
nothing to capture: `capture` refuses, and callers keep the eager function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUPS = 3  # eager calls on the side stream before the capture


def capture(fn: Callable[[], object], device, warmups: int = WARMUPS) -> Callable[[], object]:
    """`fn` (no arguments) captured as a CUDA graph on `device`; the returned function replays it and
    returns `fn`'s output from the capture (its tensors refreshed by each replay)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize(device)

    def replay():
        graph.replay()
        return out

    replay.graph = graph  # kept alive with the replay function
    return replay
