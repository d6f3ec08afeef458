"""Running stages: the pair and its config, run folders, profiles, reports, resume keys, data preparation, the recipe."""
