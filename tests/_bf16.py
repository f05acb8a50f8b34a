"""The bf16 check shared by the random-weight and the real-model tests: greedy tokens equal transformers'
in bf16 except at near-ties.

Exact equality cannot hold in bf16: the engine packs a step's sequences into one matmul and chunks
prompts, transformers runs one prompt at a time, and bf16 keeps 8 bits of mantissa, so the two sum in
different orders and round differently. So each token the engine chose is checked against the reference
run on the engine's own prefix (teacher-forced): where it is not the reference's top token, the reference
itself must have been nearly undecided, its logit for the engine's token within a near-tie of its top
logit. A wrong kernel, a mixed-up KV cache or sampling from the wrong row gives tokens the reference ranks
far below its top. Most tokens must also be the reference's top exactly: the allowance is for rounding.
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


def forced_logits(model, prompt: list[int], tokens: list[int]):
    """The reference's float32 logits for each of `tokens`, given the prompt and the tokens before it."""
    import torch

    ids = torch.tensor([prompt + tokens], dtype=torch.long)
    with torch.inference_mode():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].float()


def check_within_near_ties(reference, prompts: list[list[int]], outs, max_tokens: int) -> int:
    """Every token of every output against the bf16 reference, teacher-forced on the output's own prefix:
    each must be the reference's top token or a near-tie of it. Returns how many were its top (an exact tie
    counts). Checking every token, not only up to a first difference, keeps a later wrong token from hiding
    behind an early near-tie, and how far two outputs run before a tie splits them is luck, not a measure."""
    at_top = 0
    for prompt, out in zip(prompts, outs):
        assert out.error is None and len(out.token_ids) == max_tokens
        for step, (token, row) in enumerate(zip(out.token_ids, forced_logits(reference, prompt, out.token_ids))):
            top = float(row.max())
            behind = top - float(row[token])
            assert behind < near_tie(top), (
                f"prompt of {len(prompt)} tokens: token {step} is {token}, transformers' {int(row.argmax())}, "
                f"whose logit leads it by {behind:.3f} (a near-tie is under {near_tie(top)})")
            at_top += behind == 0
    return at_top
