"""The speed machinery: timing the handoff's paths, the physical limit, real shapes with random weights.

    timing       the four paths in two modes, synchronised trials, medians, CV screens (`Trials`, `PathOptions`)
    speed        one context length in both modes: paths, breakdown, GFLOP/s, memory, the limit (perf.py)
    roofline     each step's floor from its FLOPs and bytes at the device's peaks
    profile      where the handoff's time goes: each phase under torch.profiler, its kernels and rates (perf --profile)
    shapes       architecture-exact configs of the real models and FLOP counts at those shapes
    random_pair  random-weight models and translators at those shapes
    packing      a model's projections on oneDNN-packed weights, inside a block the caller opens
    graphs       a step replayed as one CUDA graph

The core never imports this package; benchmark.py, switch_cost.py, perf.py and frontier.py do.
"""
