"""What a step adds to its requests' outputs beyond the token: logprobs, text, and the stops that
the scheduler does not know (stop token ids, stop strings).

Runs right after Scheduler.update() on the requests sampled this step. A request stopped
here finishes in the same step with reason "stop", as an EOS would end it. Text is
detokenized incrementally (engine/detokenizer.py): here, each step, only for requests with
stop strings; the others' detokenizers follow their token lists and decode when read. A
tokenizer fault ends that request alone (reason "error"), in the step that met it or, for a
followed text, in the step after it was read.
"""

from __future__ import annotations

from kvscope.engine.isolation import describe
from kvscope.protocol.events import FINISH_ERROR, FINISH_STOP


def after_update(sched, sampled_reqs: list, finished: list, logprobs: dict | None, now: float) -> list:
    """Record this step's outputs; returns the requests that a stop token id or stop string ended now."""
    ended = []
    for req in sampled_reqs:
        if logprobs and req.req_id in logprobs:
            if req.logprobs is None:
                req.logprobs = []
            req.logprobs.append(logprobs[req.req_id])
        live = req.finish_reason is None  # update() sets a reason when EOS or a length limit ends it
        params = req.params
        reason = None
        if (live and params.stop_token_ids and req.num_output_tokens > params.min_tokens - 1
                and req.token_ids[-1] in params.stop_token_ids):
            reason = FINISH_STOP
        detok = req.detokenizer
        if detok is not None and detok.following:
            if detok.error is not None:  # met by a reader since the last step
                reason, req.error = FINISH_ERROR, detok.error
            elif reason is not None or req.finish_reason == FINISH_STOP:
                detok.end(drop_last=True)  # a stop token (EOS or a stop id) ended it
        elif detok is not None:
            try:
                hit = _feed(detok, req, by_token=reason is not None or req.finish_reason == FINISH_STOP)
            except Exception as e:  # noqa: BLE001 - a tokenizer fault ends this request only
                hit, reason = False, FINISH_ERROR
                req.error = f"detokenizing failed: {describe(e)}"
            if hit and reason is None:
                if not live:
                    req.finish_reason = FINISH_STOP  # the stop string came before the length cut
                else:
                    reason = FINISH_STOP
        if reason == FINISH_ERROR and not live:
            req.finish_reason = FINISH_ERROR
        if reason is not None and req.finish_reason is None:
            req_ended = sched.abort(req.req_id, now, reason)
            if req_ended is not None:
                ended.append(req_ended)
    for req in (*finished, *ended):
        if req.detokenizer is not None:
            req.detokenizer.finish()
    return ended


def _feed(detok, req, by_token: bool) -> bool:
    """Give the detokenizer the ids it has not seen. A stop token (EOS or a stop id) that ended the
    request is not part of the text unless include_stop_str_in_output (vLLM's rule)."""
    new = req.token_ids[req.num_prompt_tokens + detok.num_ids:]
    if by_token and new and not detok.include_stop:
        detok.num_ids += 1  # read, never to be fed later
        new = new[:-1]
    return detok.add(new)


def ending(req) -> tuple[str | None, str | None]:
    """(finish reason, error) of an ended request as its readers report it: a tokenizer fault met when its
    followed text was read, after the request ended, makes it an error."""
    detok = req.detokenizer
    if detok is not None and detok.error is not None and req.error is None:
        return FINISH_ERROR, detok.error
    return req.finish_reason, req.error
