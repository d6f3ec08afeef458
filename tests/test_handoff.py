import torch

from kvlingo.core.handoff import capture_source, greedy_generate
from kvlingo.inputs.models import ModelSpec, load_model


def native_cache(model, ids):
    cap = capture_source(model, ids)
    return cap.keys, cap.values


def test_greedy_on_injected_cache_equals_transformers_generate(tiny_pair_paths):
    model = load_model(ModelSpec.parse(str(tiny_pair_paths[1])), "cpu", torch.float32)
    ids = torch.randint(10, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    kv = native_cache(model, ids[0, :-1].tolist())
    ours, hit_cap = greedy_generate(model, ids[0, -1:].tolist(), kv, max_new_tokens=10)
    ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hit_cap and ours == ref[0, 20:].tolist()
    # a stop token ends generation and is not returned
    k = max(i for i in range(len(ours)) if ours[i] not in ours[:i])  # last first-occurrence
    stopped, hit = greedy_generate(
        model, ids[0, -1:].tolist(), native_cache(model, ids[0, :-1].tolist()), max_new_tokens=10, eos_ids={ours[k]}
    )
    assert not hit and stopped == ours[:k]
