"""Sampled tokens' log-probabilities, kept by the vLLM worker that samples them.

Asked for with ``SamplingParams(logprobs=0)``, vLLM's worker computes each sampled token's
log-probability and sends it along with the token, step by step: to the engine core, which cuts
it out of the batch for each request, then to the front end (the ``Policy`` actor's process),
which decodes and appends it, three small arrays per request per step. For a batch of short
completions that is most of what the front end spends on a step. The worker already has them in
one array per step; this mixin keeps them there instead (``capture_sampled_logprobs``), removes
them from what the worker sends, and hands each request's whole list over once, in one call,
when its caller has the finished requests (``take_sampled_logprobs``).

Every request that asks for logprobs is captured (they then arrive empty through vLLM's own
path); the policy engine's are all sampling requests of ``Policy.generate``, which takes them.
Requests that ask for none (greedy evaluation, scoring with ``prompt_logprobs``) are left alone.

vLLM names the requests in its worker ``<id>-<8 hex>`` (the front end's id and a random suffix)
and the samples of a request with ``n > 1`` ``<i>_<id>-<8 hex>``; ``request_key`` reads these
back into the front end's id and the sample's index, and ``take_sampled_logprobs`` also returns
the captured tokens, so a caller checks they are the ones it received. Under async scheduling
the worker samples a step ahead of the scheduler, so a request that stopped may have one more
token (and logprob) here than the engine returned: the caller keeps the returned length.
"""

from __future__ import annotations

import re
from collections import OrderedDict

_WORKER_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9a-f]{8}$")
MAX_KEPT = 1 << 16  # requests remembered (kept, discarded); the oldest are forgotten beyond it


def request_key(worker_request_id: str) -> tuple[str, int] | None:
    """(front-end request id, sample index) of a request id as vLLM's worker sees it; None for
    an id of another form."""
    match = _WORKER_ID.match(worker_request_id)
    return None if match is None else (match.group(2), int(match.group(1) or 0))


class SampledLogprobsCapture:
    """Worker-extension methods (mixed into each vLLM worker, ``self.model_runner`` its model
    runner)."""

    _captured: OrderedDict[str, tuple[list[int], list[float]]]
    _discarded: OrderedDict[str, None]

    def capture_sampled_logprobs(self) -> bool:
        """Start keeping sampled logprobs here (repeated calls do nothing)."""
        runner = self.model_runner
        if getattr(runner.sample_tokens, "captures_logprobs", False):
            return True
        self._captured = OrderedDict()
        # Front-end ids of taken and aborted requests: an aborted request's samples may reach the
        # engine after the abort (vLLM sends them one by one), and under async scheduling a taken
        # request's sample one step past its stop may come after the take; nothing would take
        # their logprobs.
        self._discarded = OrderedDict()
        vllm_sample_tokens = runner.sample_tokens

        def sample_tokens(*args, **kwargs):
            wanted = set(runner.input_batch.num_logprobs)  # the batch's requests that asked for logprobs
            output = vllm_sample_tokens(*args, **kwargs)
            if not wanted:
                return output
            if hasattr(output, "get_output"):  # async scheduling: the output is made later
                vllm_get_output = output.get_output

                def get_output():
                    return self._keep_logprobs(vllm_get_output(), wanted)

                output.get_output = get_output
                return output
            return self._keep_logprobs(output, wanted)

        sample_tokens.captures_logprobs = True
        runner.sample_tokens = sample_tokens
        return True

    def _keep_logprobs(self, output, wanted: set[str]):
        lists = getattr(output, "logprobs", None)
        if lists is None:
            return output
        starts = lists.cu_num_generated_tokens
        token_ids, logprobs = lists.logprob_token_ids[:, 0].tolist(), lists.logprobs[:, 0].tolist()
        for i, (rid, sampled) in enumerate(zip(output.req_ids, output.sampled_token_ids, strict=True)):
            if rid not in wanted or not sampled:
                continue
            kept = self._captured.get(rid)
            if kept is None:
                key = request_key(rid)
                if key is not None and key[0] in self._discarded:
                    continue
                kept = self._captured[rid] = ([], [])
                _bound(self._captured)
            row = starts[i] if starts is not None else i
            for k, token in enumerate(sampled):
                if token_ids[row + k] != token:
                    raise RuntimeError(f"vLLM's logprobs row for {rid!r} is not its sampled token's")
                kept[0].append(token)
                kept[1].append(logprobs[row + k])
        output.logprobs = None  # the rows for requests that asked for none are nobody's either
        return output

    def kept_sampled_logprobs(self) -> int:
        """Requests whose logprobs this worker keeps, not taken yet."""
        return len(getattr(self, "_captured", {}))

    def take_sampled_logprobs(self, request_ids: list[str], n: int, discard: list[str] = ()) -> list:
        """For each front-end request id, its ``n`` samples' ``[tokens, logprobs]`` (None for a
        sample this worker has none of: not captured, or forgotten), removed from here; requests
        of ``discard`` (ids of requests that were aborted) are only removed."""
        wanted = {rid: i for i, rid in enumerate(request_ids)}
        dropped = set(discard)
        # Taken or aborted: a sample of theirs that comes later (async scheduling samples a step
        # past a stop, in the worker's output thread) is dropped instead of kept for nobody.
        for rid in (*request_ids, *discard):
            self._discarded[rid] = None
            _bound(self._discarded)
        out: list[list] = [[None] * n for _ in request_ids]
        for worker_id in list(self._captured):
            key = request_key(worker_id)
            if key is None or (key[0] not in wanted and key[0] not in dropped):
                continue
            tokens, logprobs = self._captured.pop(worker_id)
            rid, index = key
            if rid in wanted and index < n:
                out[wanted[rid]][index] = [tokens, logprobs]
        return out


def _bound(kept: OrderedDict) -> None:
    """Forget the oldest entries beyond ``MAX_KEPT``."""
    while len(kept) > MAX_KEPT:
        kept.popitem(last=False)
