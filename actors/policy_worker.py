"""The methods the ``Policy`` actor's engine mixes into each of its vLLM workers
(``worker_extension_cls``): weight updates from the store (``weightsync.vllm_extension``) and
the sampled tokens' logprobs kept where they are sampled (``actors.sampled_logprobs``)."""

from __future__ import annotations

from actors.sampled_logprobs import SampledLogprobsCapture
from weightsync.vllm_extension import WeightSyncExtension


class PolicyWorkerExtension(WeightSyncExtension, SampledLogprobsCapture):
    pass
