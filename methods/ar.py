"""Plain autoregressive decoding: the baseline. It proposes nothing, so each engine step is
one target forward over the last token."""

from dataclasses import dataclass

from specbench.methods.base import Proposer


class AR(Proposer):
    name = "ar"

    @dataclass
    class Settings:  # plain autoregressive decoding: the baseline every speedup is measured against
        name: str = "ar"

    @classmethod
    def spec_len(cls, cfg, device) -> None:
        return None  # drafts nothing

    @classmethod
    def vllm_config(cls, cfg) -> None:
        return None  # vLLM's plain decoding
