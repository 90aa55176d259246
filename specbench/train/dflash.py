"""Training a DFlash drafter (``specbench/drafters/dflash.py``), or a DSpark one
(``drafters/dspark.py``: ``drafter=dspark``), on the feature set.

Each sequence gives ``anchors`` random block starts p (among its valid positions, so that p and
at least one later token exist). Block p is ``[x_p, MASK x (B-1)]`` at positions p..p+B-1 and sees
the target's fused states of tokens 0..p-1 and its own slots (``DFlashDrafter.train_forward``, the
paper's anchored blocks, many in one forward). Slot k (k >= 1) is trained towards the target's own
distribution of token p+k (its output layer on the stored final state at p+k-1): soft
cross-entropy over the full vocabulary, weighted exp(-(k-1)/gamma) (DFlash's decay; gamma 4 as
speculators trains it). The draft layers start from the target's last layers (``init: target``,
our choice on a CPU budget; ``random``: as the paper trains) and the mask token is an added
special token the data never holds (or ``drafter.mask_token_id``).

DSpark drafts from its anchor slot (slot k drafts x_{p+k+1}). Its Markov head is trained
teacher-forced (slot k's previous token is the data's x_{p+k}) inside the same cross-entropy, and
its confidence head by binary cross-entropy towards the slot's 1 - TV(draft, target) (its
acceptance probability under the sampling rule), weighted as the slot's cross-entropy and by
``confidence_alpha``, as DeepSpec and speculators train it.

Held-out sequences give the summary: top-1 agreement with the target's greedy token per slot,
and the expected accepted drafts a block (the chain's product of agreements, summed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.drafters.dflash import DFlashDrafter, default_layer_ids, exp_decay, layer_config, taps_of
from specbench.drafters.dspark import DSparkDrafter
from specbench.errors import ConfigError
from specbench.train.heads import collate
from specbench.train.loop import fit_and_score

DATA = "features"  # the trainer of drafter=dflash and dspark (the interface: specbench/train/__init__.py)


def layers(cfg, num_target_layers: int) -> list:
    """The states after its target layers, and the teacher's."""
    ids = layer_ids(cfg.drafter, num_target_layers)
    return [t for t in taps_of(ids, num_target_layers) if t != "final"] + ["final"]


def min_seq_len(dr) -> int:
    """A context before the anchor, the anchor and the token after it."""
    return 3


def said(s: dict) -> str:
    return (f"held-out top-1 agreement per slot {[round(x, 3) for x in s['eval_top1_agreement']]}, "
            f"expected accepted {s['eval_expected_accepted']:.2f}")


def layer_ids(dr, num_target_layers: int) -> list[int]:
    ids = list(dr.target_layers) if dr.get("target_layers") else default_layer_ids(num_target_layers, int(dr.layers))
    try:
        taps_of(ids, num_target_layers)
    except ValueError as e:
        raise ConfigError(f"drafter.target_layers: {e}") from None
    return [int(i) for i in ids]


def mask_token(dr, tokenizer, items) -> int:
    """``drafter.mask_token_id``, else the tokenizer's mask token, else the highest-id added special
    token the feature set never holds (a block's mask slots must not look like text)."""
    if dr.get("mask_token_id") is not None:
        return int(dr.mask_token_id)
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    seen = set()
    for it in items:
        seen |= set(it["tokens"].unique().tolist())
    added = sorted(getattr(tokenizer, "added_tokens_decoder", {}) or {}, reverse=True)
    free = [i for i in added if i not in seen and i not in (tokenizer.eos_token_id, tokenizer.bos_token_id,
                                                            tokenizer.pad_token_id)]
    if not free:
        raise ConfigError("the tokenizer has no mask token and every added token occurs in the data: set "
                          "drafter.mask_token_id=<an id the text never holds>")
    return int(free[0])


def pick_anchors(valid: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """[B, n] block starts per row among its positions 1..len-2 (a context before, a token after),
    drawn without replacement where the row has enough (else with)."""
    lens = valid.sum(1)
    out = []
    for length in lens.tolist():
        hi = max(2, int(length) - 1)
        pool = torch.arange(1, hi)
        pick = pool[torch.randperm(len(pool), generator=gen)[:n]]
        if len(pick) < n:
            pick = torch.cat([pick, pool[torch.randint(len(pool), (n - len(pick),), generator=gen)]])
        out.append(pick.sort().values)
    return torch.stack(out).to(valid.device)


def dflash_loss(model: DFlashDrafter, tok, taps, fin, valid, anchors, weights, head, confidence_alpha: float = 1.0):
    """Soft cross-entropy of every slot against the target's distribution of its token (and, for
    DSpark, its confidence's binary cross-entropy), and the top-1 agreement per draft (slot order)."""
    h = model.train_forward(taps, tok, valid, anchors)  # [B, A, Bk, d]
    Bt, A, Bk, _ = h.shape
    first = 1 if model.anchor == "bonus" else 0
    slots = torch.arange(first, Bk, device=tok.device)
    teacher_at = anchors[:, :, None] + slots - 1 + (model.anchor == "next")  # the final state that predicts it
    ok = teacher_at < valid.sum(1)[:, None, None]
    teacher_at = teacher_at.clamp(max=fin.shape[1] - 1)
    t_states = fin.gather(1, teacher_at.reshape(Bt, -1, 1).expand(-1, -1, fin.shape[-1])).view(Bt, A, len(slots), -1)
    with torch.no_grad():  # the teacher in fp32 whatever the target's dtype
        p = torch.softmax(F.linear(t_states.float(), head.weight.float()), -1)
    conf = None
    if isinstance(model, DSparkDrafter):  # the token before each slot's is the one whose state predicts it
        logits, conf = model.train_logits(h[:, :, first:], tok.gather(1, teacher_at.reshape(Bt, -1)).view_as(teacher_at))
        logits = logits.float()
    else:
        logits = model.logits(h[:, :, first:]).float()
    logq = torch.log_softmax(logits, -1)
    ce = -(p * logq).sum(-1)  # [B, A, drafts]
    w = weights[first:].to(tok.device)[None, None] * ok
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    if conf is not None:
        with torch.no_grad():
            accept = (1.0 - 0.5 * (logq.exp() - p).abs().sum(-1)).clamp(0.0, 1.0)
        bce = F.binary_cross_entropy_with_logits(conf.float(), accept, reduction="none")
        loss = loss + confidence_alpha * (bce * w).sum() / w.sum().clamp(min=1e-9)
    agree = ((logits.argmax(-1) == p.argmax(-1)) & ok).float().sum((0, 1)) / ok.float().sum((0, 1)).clamp(min=1)
    return (loss, *agree.detach())


def build(dr, tc, target, ids: list[int], block: int, mask: int) -> DFlashDrafter:
    """The untrained drafter ``drafter=`` names: DFlash's (bonus anchor) or DSpark's (next anchor, heads)."""
    cfg = layer_config(tc, int(dr.layers), mask, block, ids)
    if dr.kind == "dspark":
        d = DSparkDrafter(target, cfg, ids, block, mask, "next", markov_rank=int(dr.markov_rank),
                          markov_type=str(dr.markov_type), confidence=bool(dr.confidence),
                          confidence_with_markov=bool(dr.confidence_with_markov))
        with torch.no_grad():  # the heads start small (std 0.02, zero biases), as DeepSpec's do
            for head in (d.markov_head, d.confidence_head):
                for p in (head.parameters() if head is not None else ()):
                    p.normal_(0.0, 0.02) if p.dim() > 1 else p.zero_()
        return d
    return DFlashDrafter(target, cfg, ids, block, mask)


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    torch.manual_seed(int(cfg.seed))
    gen = torch.Generator().manual_seed(int(cfg.seed))
    tc = target.config.get_text_config()
    ids, block = layer_ids(dr, int(tc.num_hidden_layers)), int(dr.block_size)
    mask = mask_token(dr, tokenizer, items)
    if not 0 <= mask < int(tc.vocab_size):
        raise ConfigError(f"the mask token {mask} is outside the target's {tc.vocab_size} tokens: set drafter.mask_token_id")
    model = build(dr, tc, target, ids, block, mask)
    if dr.get("init", "target") == "target":  # the target's last layers (its q/k norms start at one)
        from specbench.drafters.formats.dflash import OURS

        with torch.no_grad():
            for mine, theirs in zip(model.layers, target.model.layers[-len(model.layers):]):
                for name, ours in OURS.items():
                    if ours not in ("q_norm", "k_norm"):  # a Llama target has none
                        getattr(mine, ours).weight.copy_(theirs.get_submodule(name).weight)
    model.to(device)
    head = target.get_output_embeddings()
    weights = exp_decay(block, float(dr.gamma), model.anchor)
    L, A = int(tcfg.seq_len), int(dr.anchors)

    def loss_of(batch):
        tok, taps, valid = collate(batch, L, device, layers=model.taps)
        fin = collate(batch, L, device)[1]
        return dflash_loss(model, tok, taps, fin, valid, pick_anchors(valid, A, gen), weights, head,
                           float(dr.get("confidence_alpha", 1.0)))

    def replay(batch):  # a skipped step's anchor draws
        pick_anchors(collate(batch, L, "cpu")[2], A, gen)

    res = fit_and_score(cfg, model, items, out, loss_of, progress, replay)
    res["summary"] |= {"trained_block_positions": int(tcfg.steps) * res["summary"]["batch_size"] * A * model.drafts,
                       "mask_token_id": mask, "target_layer_ids": ids}
    return {"draft": model, "extra": {}, **res}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    """Write the checkpoint (config.json + model.safetensors, bf16: Z Lab's layout for DFlash,
    DeepSpec's for DSpark), its drafter.json and card."""
    from specbench.drafters.formats.dflash import save
    from specbench.train import card

    model, dr = result["draft"], cfg.drafter
    meta = card.feature_meta(cfg, result, target_name, data_meta, command,
                             kind=str(dr.kind), name=dr.name, target=target_name,
                             target_vocab_size=int(model.vocab_size), draft_vocab=int(model.vocab_size))
    save(out, model, anchors=int(dr.anchors))
    card.write(out, meta)


def card_body(meta: dict) -> list[str]:
    """A DFlash or DSpark card's description, data and training sections (``card.render`` adds the rest)."""
    from specbench.train import card

    s, ts, dr = meta["train_summary"], meta["train_settings"], meta["drafter"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    dspark = meta["kind"] == "dspark"
    heads = (f" + a {dr['markov_type']} Markov head of rank {dr['markov_rank']} and "
             f"{'a confidence head' if dr['confidence'] else 'no confidence head'}" if dspark else "")
    return [
        f"# {meta['name']}: {'DSpark' if dspark else 'DFlash'} drafter for {meta['target']}", "",
        f"A block-diffusion drafter for `method={meta['kind']}` ({'DeepSpec' if dspark else 'Z Lab'}'s layout): "
        f"fc([the target's states after decoder layers {s['target_layer_ids']}]) -> {dr['layers']} non-causal draft "
        f"layer(s) over [context ; block of {dr['block_size']}] -> the target's output layer{heads}; mask token "
        f"{s['mask_token_id']}. Only the drafter's own weights are stored ({s['trainable_params']:,} parameters, bf16); "
        "the embedding and output layer are the target's.",
        *card.feature_data(meta),
        "", "## Training",
        f"- {s['steps']} steps, batch {ts['batch_size']} x up to {ts['seq_len']} tokens x {dr['anchors']} blocks, "
        f"AdamW lr {ts['lr']}, loss decay gamma {dr['gamma']}, layers initialised from the {dr.get('init')}, "
        f"seed {meta['seed']}; {s['trained_block_positions']:,} drafted positions seen",
        card.losses(s),
        card.agreement(s, "block slot", agree, "a block (chain product)")
        + (" (teacher-forced: the Markov head reads the data's previous tokens, not its own drafts)" if dspark else ""),
    ]


def card_use(meta: dict, where: str) -> list[str]:
    """Its card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``."""
    from specbench.train import card

    kind = meta["kind"]
    return [*card.run_block(kind, where),
            f"Drafts with the block it was trained with; `{kind}.block_size=<B>` drafts with another.",
            *(["`dspark.threshold=<c>` verifies a row's drafts up to the first slot whose confidence is below c."]
              if kind == "dspark" else [])]
