"""The bf16 check shared by the random-weight and the real-model tests: greedy tokens equal transformers'
in bf16 except at near-ties (issue 29).

Exact equality cannot hold in bf16: the engine packs a step's sequences into one matmul and chunks
prompts, transformers runs one prompt at a time, and bf16 keeps 8 bits of mantissa, so the two sum in
different orders and round differently. Where their greedy tokens first differ, the reference itself
must have been nearly undecided: its logit for the engine's token lies within NEAR_TIE of its top logit
(so its top-2 gap is under NEAR_TIE too). A wrong kernel, a mixed-up KV cache or sampling from the wrong
row gives tokens the reference ranks far below its top.
"""

from __future__ import annotations

# In logits (natural-log units). bf16's relative rounding is 2**-8; these models' logits are O(1-10)
# and pass through a few layers, so a disagreement from rounding alone stays well under this.
NEAR_TIE = 0.25
# The reference's logits are themselves bf16: at a top logit of 23.6 (SmolLM2's, measured) one unit in the
# last place is 0.125, so a gap of 0.375 is three roundings apart. A near-tie is also anything within
# ULPS_OF_TIE such units of the top logit (seen on a Xeon with AMX, whose bf16 GEMMs sum in another order
# than Zen 5's avx512_bf16: 23.625 against 23.25 at the first difference).
ULPS_OF_TIE = 4


def near_tie(top: float) -> float:
    """The gap under which two logits of about `top` are a near-tie in bf16."""
    import math

    ulp = 2.0 ** (math.floor(math.log2(abs(top))) - 7) if top else 0.0
    return max(NEAR_TIE, ULPS_OF_TIE * ulp)


def greedy_with_logits(model, prompt: list[int], n: int):
    """transformers' greedy generate (batch 1) and the float32 logits behind each of its choices."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits]


def check_up_to_near_ties(reference, prompts: list[list[int]], outs, max_tokens: int) -> int:
    """Each output against the bf16 reference's greedy tokens; returns how many tokens agreed before the first
    difference, over all prompts. Fails where a first difference is not a near-tie of the reference."""
    agreed = 0
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == max_tokens
        expected, logits = greedy_with_logits(reference, prompt, max_tokens)
        first = next((i for i, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b), None)
        if first is None:
            agreed += max_tokens
            continue
        agreed += first
        row = logits[first]
        top2 = row.topk(2).values
        behind = float(row.max() - row[out.token_ids[first]])
        tie = near_tie(float(top2[0]))
        assert float(top2[0] - top2[1]) < tie and behind < tie, (
            f"prompt of {len(prompt)} tokens: token {first} is {out.token_ids[first]}, transformers' "
            f"{expected[first]}, whose logit leads it by {behind:.3f} (a near-tie is under {tie})")
    return agreed
