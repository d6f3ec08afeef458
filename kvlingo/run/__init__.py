"""The foundation every stage stands on: the pair and its config, run folders, profiles, reports, resume keys,
prepared data, the evidence gate and the exported folder format. It imports no training, evaluation, speed or
orchestration code."""
