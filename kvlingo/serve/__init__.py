"""Serving: a vLLM KV connector that starts a request from another model's translated cache.

    contract   the compatibility contract between an exported translator and a served model (no vLLM)
    layer0     the target's layer 0 from its checked layer-0 tensors alone (token features, exact:0; no vLLM)
    store      the source caches engines save, per conversation, for another engine to translate (no vLLM)
    paged      writing K/V through a vLLM engine's own cache writer, and reading them back
    connector  `KvlingoConnector` (vLLM v1) and `engine_args`, the settings of an engine that uses it

Only `paged` and `connector` import vLLM; they run in the serving environment (`make serve-env`).
"""
