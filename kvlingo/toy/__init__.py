"""The offline toy world (a fixture, apart from the core): procedural corpus, tokenizer, toy Qwen3 pair, random pairs.

No stage of a real run imports this package, so editing it never changes a real run's code hash.
"""
