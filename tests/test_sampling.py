"""Nucleus filtering: privcode's NumPy-sorted filter against Hugging Face's TopPLogitsWarper.

The reference is HF's own warper (torch sort, cumulative softmax); the two
must remove exactly the same tokens, and a ``generate`` call through
:func:`sampling_kwargs` must draw exactly the tokens HF's ``top_p`` draws.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from privcode.models.sampling import NucleusFilter, sampling_kwargs


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("scale", [0.3, 1.0, 10.0])  # flat, natural and peaked rows
def test_nucleus_filter_removes_exactly_what_hf_removes(top_p, scale):
    gen = torch.Generator().manual_seed(int(top_p * 1000) + int(scale * 10))
    scores = torch.randn(8, 6144, generator=gen) * scale
    ours = NucleusFilter(top_p)(None, scores.clone())
    ref = TopPLogitsWarper(top_p)(None, scores.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[~torch.isinf(ours)], scores[~torch.isinf(ref)])  # kept scores unchanged
    kept = (~torch.isinf(ours)).sum(dim=-1)
    assert (kept >= 1).all() and (kept < 6144).all()


def test_nucleus_filter_keeps_the_top_token_and_the_mass():
    scores = torch.tensor([[10.0, 0.0, 0.0, 0.0], [1.0, 0.9, 0.8, -5.0]])
    out = NucleusFilter(0.5)(None, scores.clone())
    assert torch.isinf(out[0, 1:]).all() and out[0, 0] == 10.0  # one token holds > p
    probs = scores[1].softmax(-1)
    kept = ~torch.isinf(out[1])
    assert probs[kept].sum() >= 0.5 and probs[kept].sum() - probs[kept].min() < 0.5  # smallest set
    assert torch.equal(NucleusFilter(1.0)(None, scores.clone()), scores)
    with pytest.raises(ValueError, match="top_p"):
        NucleusFilter(0.0)


def test_sampling_kwargs_greedy_and_sampled():
    assert sampling_kwargs(0.0, 0.9) == {"do_sample": False}
    kw = sampling_kwargs(0.7, 1.0)
    assert kw == {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 0}
    kw = sampling_kwargs(0.7, 0.9)
    assert kw["top_p"] == 1.0 and isinstance(kw["logits_processor"][0], NucleusFilter)
    assert kw["logits_processor"][0].temperature == 0.7


def test_nucleus_filter_chooses_the_nucleus_of_the_tempered_scores():
    """generate runs custom processors before its temperature: the filter divides itself."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    scores = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)) * 2
    ours = NucleusFilter(0.9, temperature=0.5)(None, scores.clone())
    ref = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.5)(None, scores.clone()))
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[~torch.isinf(ours)], scores[~torch.isinf(ref)])  # untempered
    assert not torch.equal(torch.isinf(NucleusFilter(0.9)(None, scores.clone())), torch.isinf(ref))


def test_generate_with_the_filter_draws_what_hf_top_p_draws():
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(
        T.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=512,
        )
    ).eval()
    ids = torch.randint(0, 512, (4, 5))

    def draw(**kw):
        torch.manual_seed(123)
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=24,
                pad_token_id=0,
                **kw,
            )

    ref = draw(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)
    assert torch.equal(draw(**sampling_kwargs(0.7, 0.9)), ref)
    assert not torch.equal(draw(**sampling_kwargs(0.7, 1.0)), ref)  # the filter did something
