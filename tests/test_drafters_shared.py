"""A drafter borrows parts of its target (embedding, rotary tables, output rows) without owning
them: loading one in another dtype or device must leave every tensor of the target as it was
(the target is shared by every job of a sweep, and its AR baseline runs on it)."""

import pytest
import torch

from helpers import tiny_llama
from specbench import drafters
from specbench.drafters.draft_lm import DraftLM
from specbench.drafters.eagle import EagleDrafter
from specbench.drafters.medusa import MedusaHeads
from specbench.drafters.specdec import SpecDrafter


def _make(kind, target):
    V = target.config.vocab_size
    vocab = torch.arange(0, V, 2)
    if kind == "draft_lm":
        return DraftLM(target, 1, vocab), {"layers": 1}
    if kind == "specdec":
        return SpecDrafter(target, 1, vocab, 3), {"layers": 1, "k": 3}
    if kind == "eagle":
        return EagleDrafter(target, vocab), {}
    if kind == "medusa":
        return MedusaHeads(target, vocab, 2), {"heads": 2}
    raise KeyError(kind)


def _snapshot(model):
    return {n: (t.dtype, t.device, t.detach().clone()) for n, t in
            list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", sorted(k for k, v in drafters.KINDS.items() if v.format is None))  # specbench's own format
def test_loading_a_drafter_in_bf16_changes_no_tensor_of_the_target(tmp_path, kind, target_dtype):
    target = tiny_llama(seed=0)
    if target_dtype != torch.float32:  # as from_pretrained(dtype=bf16) leaves it: weights bf16, RoPE tables fp32
        for p in target.parameters():
            p.data = p.data.to(target_dtype)
    assert target.model.rotary_emb.inv_freq.dtype == torch.float32
    drafter, meta = _make(kind, target)
    drafters.save(drafter, tmp_path / kind, {"kind": kind, "target_vocab_size": target.config.vocab_size, **meta})
    before = _snapshot(target)
    loaded = drafters.load(tmp_path / kind, target, torch.device("cpu"), torch.bfloat16, kind=kind)
    after = _snapshot(target)
    assert after.keys() == before.keys()
    for name, (dtype, device, value) in before.items():
        assert after[name][0] == dtype, f"{kind}: the target's {name} went {dtype} -> {after[name][0]}"
        assert after[name][1] == device, name
        assert torch.equal(after[name][2], value), f"{kind}: the target's {name} changed value"
    # the drafter itself is bf16 where it owns its weights, and none of them is the target's
    own = {id(t) for t in list(loaded.parameters()) + list(loaded.buffers())}
    assert not own & {id(t) for t in list(target.parameters()) + list(target.buffers())}
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
