"""The offline toy world (a fixture, apart from the core): procedural corpus, tokenizer, the toy Qwen3 pair and the
deep model.

Only toy_world.py and the tests import this package, so editing it never changes a real run's code hash.
"""
