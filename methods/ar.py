"""Plain autoregressive decoding: the baseline. It proposes nothing, so each engine step is
one target forward over the last token."""

from specbench.methods.base import Proposer


class AR(Proposer):
    name = "ar"

    @classmethod
    def spec_len(cls, cfg, device) -> None:
        return None  # drafts nothing

    @classmethod
    def vllm_config(cls, cfg) -> None:
        return None  # vLLM's plain decoding
