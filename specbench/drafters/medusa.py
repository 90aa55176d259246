"""Medusa heads (Cai et al. 2024, arXiv 2401.10774).

Head k (k = 1..n_heads) reads the target's last hidden state ``f_t`` at the last committed
position (after the final norm, the state the target's own output layer turns into token
t+1) and predicts token t+1+k:

    logits_k = head(f_t + SiLU(W_k f_t + b_k))

one residual block per head (W_k starts at zero, so every head starts as the target's own
output layer), and the target's output layer restricted to the draft vocabulary, shared by
all heads instead of one 49k-row copy per head (the paper's Medusa-1 copies it).

The tree of candidates (top-i of head 1, then top-j of head 2 under it, ...) is chosen
from the heads' measured top-i accuracies on held-out data, as the paper does: the paths
with the largest product of accuracies, stored in the checkpoint (``acc``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbench import kernels
from specbench.drafters import Drafter, TargetParts
from specbench.hf import text_config


class MedusaHeads(Drafter):
    kind = "medusa"

    def __init__(self, target, vocab_ids: torch.Tensor, n_heads: int):
        super().__init__()
        d = text_config(target.config).hidden_size
        self.n_heads = n_heads
        self.vocab_size = int(text_config(target.config).vocab_size)
        self.weight = nn.Parameter(torch.zeros(n_heads, d, d))
        self.bias = nn.Parameter(torch.zeros(n_heads, d))
        self.register_buffer("vocab_ids", vocab_ids.clone().long(), persistent=True)
        self.parts = TargetParts(target, self.vocab_ids)

    def logits_of(self, f: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary (what head 0 would be)."""
        return self.parts.logits(f)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """f [..., d] -> logits over the draft vocabulary [n_heads, ..., V']."""
        shape = f.shape
        x = f.reshape(-1, shape[-1])
        z = kernels.heads_like(x, self.weight.to(f.dtype), self.parts.target.get_output_embeddings(), self)
        h = x[None] + F.silu(z + self.bias.to(f.dtype)[:, None])
        return self.output(h).view(self.n_heads, *shape[:-1], -1)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """[n_heads, n, d] after each head's residual block -> logits [n_heads, n, V']: the
        target's output layer over the draft vocabulary."""
        return self.parts.logits(h)


def sparse_tree(acc: list[list[float]], size: int) -> list[tuple[int, ...]]:
    """The ``size`` paths (tuples of per-depth top-i ranks) with the largest product of
    head accuracies ``acc[k][i]`` (head k+1's top-(i+1) accuracy), breadth first. A path's
    prefix always has a larger product, so the set is a tree."""
    import heapq

    heap = [(-acc[0][i], (i,)) for i in range(len(acc[0]))]
    heapq.heapify(heap)
    out = []
    while heap and len(out) < size:
        negp, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(acc):
            for i in range(len(acc[len(path)])):
                heapq.heappush(heap, (negp * acc[len(path)][i], path + (i,)))
    return sorted(out, key=lambda p: (len(p), p))


def build(meta: dict, state: dict, target) -> MedusaHeads:
    return MedusaHeads(target, state["vocab_ids"], int(meta["heads"]))


def vllm_folder(checkpoint, target_dir: str, out, k: int) -> str:
    """Our Medusa heads (a ``medusa`` checkpoint folder) in vLLM's Medusa layout, for
    ``backend=vllm``: ``config.json`` (``model_type: medusa``, the first ``k`` heads, one residual
    block each, with bias) and ``model.safetensors`` (``blocks.{i}.layers.0.{weight,bias}``, each
    head's output layer ``lm_heads.{i}.weight``: the target's output rows for our draft vocabulary,
    zeros elsewhere). On the draft vocabulary the scores are ours; elsewhere 0, not our -inf (vLLM
    0.32's ``token_map`` would give -inf, but its loader asserts full-vocabulary heads first, so a
    truncated head cannot load). Written once (atomically)."""
    import json
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from specbench.hf import folder_weights

    out, src = Path(out), Path(target_dir)
    if (out / "config.json").exists():
        return str(out)
    state = load_file(str(Path(checkpoint) / "model.safetensors"))
    head = folder_weights(src)[1]
    ids = state["vocab_ids"].long()
    restricted = torch.zeros_like(head)
    restricted[ids] = head[ids]
    w = {}
    for i in range(k):
        w[f"blocks.{i}.layers.0.weight"] = state["weight"][i].float().contiguous()
        w[f"blocks.{i}.layers.0.bias"] = state["bias"][i].float().contiguous()
        w[f"lm_heads.{i}.weight"] = restricted.clone()
    tcfg = json.loads((src / "config.json").read_text())
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": int(tcfg["hidden_size"]),
           "vocab_size": int(tcfg["vocab_size"]), "num_heads": int(k), "num_hidden_layers": 1, "medusa_fc_bias": True,
           "dtype": "float32"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    save_file(w, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tmp.rename(out)
    return str(out)
