"""Training an MTP module (``specbench/drafters/mtp.py``) for a target that ships none, with
FastMTP's recipe (arXiv 2509.18362): one shared block trained over ``steps`` recursive steps on
self-distilled data, the steps' losses weighted beta^k / sum_j beta^j (its Equation 2, beta 0.6).

Step k's entry i reads the token x_{i+k+1} and, as its state, the target's final state h_i (k = 0)
or step k-1's fed-back output at i; it predicts x_{i+k+2} (``MTPDrafter.train_logits``, the
teacher-forced recursion speculators trains too). The loss of a prediction is the soft
cross-entropy towards the target's own distribution of that token (its output layer on the stored
final state before it): the feature set is the target's own answers, so this is FastMTP's
self-distillation with the whole distribution instead of the sampled token. The block is
speculators' ``mtp`` kind (the embedding first in the fusion, the normed state fed back); its
decoder layer starts from the target's last layer, its fusion ``proj`` from passing the state
through (``[0 | I]``), its norms at one (``init: target``; ``random``: std 0.02).

Held-out sequences give the summary: the top-1 agreement with the target's greedy token per step
and the expected accepted drafts of a chain (the product of agreements, summed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from specbench.drafters.mtp import MTPDrafter
from specbench.errors import ConfigError
from specbench.train.heads import collate
from specbench.train.loop import fit_and_score

DATA = "features"  # the trainer of drafter=mtp (the interface: specbench/train/__init__.py)


def layers(cfg, num_target_layers: int) -> list:
    """The final state (as ``features.layers`` names it)."""
    return list(cfg.features.layers)


def min_seq_len(dr) -> int:
    """A token and its ``steps`` recursive steps past the next."""
    return int(dr.steps) + 2


def said(s: dict) -> str:
    return (f"held-out top-1 agreement per step {[round(x, 3) for x in s['eval_top1_agreement']]}, "
            f"expected accepted {s['eval_expected_accepted']:.2f}")


def step_weights(beta: float, steps: int) -> torch.Tensor:
    """FastMTP's normalised exponential decay: beta^k / sum_j beta^j, k = 0..steps-1."""
    w = torch.tensor([beta ** k for k in range(steps)])
    return w / w.sum()


def build(target, init: str) -> MTPDrafter:
    d = MTPDrafter(target, "speculators")
    if any(".experts." in k for k in d.state_dict()):
        raise ConfigError("an MoE target's MTP block has no speculators layout specbench writes: drafter=mtp trains "
                          "for dense targets")
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.zero_() if name.endswith("bias") else p.fill_(1.0)
        if init == "target":
            d.layer.load_state_dict(target.model.layers[-1].state_dict())
            n = d.proj.out_features
            d.proj.weight.zero_()
            d.proj.weight[:, n:] = torch.eye(n)
    return d


def mtp_loss(model: MTPDrafter, tok, fin, valid, weights, head, steps: int):
    """The weighted soft cross-entropy over every step, and each step's top-1 agreement."""
    T = tok.shape[1]
    n = T - steps - 1
    logits = model.train_logits(tok, fin, steps)  # per step [B, n, V]
    with torch.no_grad():  # the target's distribution of every token x_{j+1} (from its final state at j), once
        teacher = torch.softmax(F.linear(fin[:, :T - 1].float(), head.weight.float()), -1)  # [B, T-1, V]
    loss, agree = 0.0, []
    for k, lg in enumerate(logits):
        p = teacher[:, k + 1:k + 1 + n]  # entry i of step k predicts x_{i+k+2}: the state at i+k+1 predicts it
        ok = valid[:, k + 2:k + 2 + n]
        ce = -(p * torch.log_softmax(lg.float(), -1)).sum(-1)
        den = ok.sum().clamp(min=1)
        loss = loss + weights[k] * (ce * ok).sum() / den
        agree.append((((lg.argmax(-1) == p.argmax(-1)) & ok).sum() / den).detach())
    return (loss, *agree)


def train(cfg, target, tokenizer, items: list[dict], out: Path, eos: set[int], device, progress: bool = True) -> dict:
    tcfg, dr = cfg.train, cfg.drafter
    torch.manual_seed(int(cfg.seed))
    steps = int(dr.steps)
    model = build(target, str(dr.get("init", "target"))).to(device)
    head = target.get_output_embeddings()
    weights = step_weights(float(dr.beta), steps).to(device)
    L = int(tcfg.seq_len)

    def loss_of(batch):
        tok, fin, valid = collate(batch, L, device)
        return mtp_loss(model, tok, fin, valid, weights, head, steps)

    res = fit_and_score(cfg, model, items, out, loss_of, progress)
    res["summary"] |= {"trained_positions": int(tcfg.steps) * res["summary"]["batch_size"] * L * steps,
                       "step_weights": weights.tolist()}
    return {"draft": model, **res}


def finish(cfg, result: dict, out: Path, target_name: str, data_meta: dict, command: str) -> None:
    """Write the checkpoint in speculators' ``mtp`` layout (bf16), its drafter.json and card."""
    from specbench.drafters.formats.mtp import save
    from specbench.train import card

    model, dr = result["draft"], cfg.drafter
    meta = card.feature_meta(cfg, result, target_name, data_meta, command,
                             kind="mtp", name=dr.name, target=target_name,
                             target_vocab_size=int(model.config.vocab_size), draft_vocab=int(model.config.vocab_size))
    save(out, model, steps=int(dr.steps))
    card.write(out, meta)


def card_body(meta: dict) -> list[str]:
    """Its card's description, data and training sections (``card.render`` adds the rest)."""
    from specbench.train import card

    s, ts, dr = meta["train_summary"], meta["train_settings"], meta["drafter"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    return [
        f"# {meta['name']}: MTP module for {meta['target']}", "",
        "A multi-token-prediction module for `method=mtp` (vLLM's speculators `mtp` layout): the embedding of the next "
        "token and the previous state, each normed, fused by `input_proj`, one decoder layer of the target's kind, a final "
        f"norm, the target's output layer; its normed output is fed back for the next draft. Only its own weights are "
        f"stored ({s['trainable_params']:,} parameters, bf16).",
        *card.feature_data(meta),
        "", "## Training",
        f"- FastMTP's recipe: {dr['steps']} recursive steps, loss weights beta^k normalised (beta {dr['beta']}), soft "
        f"cross-entropy towards the target's distribution; {card.budget(s, ts)}, initialised from the "
        f"{dr.get('init')}, seed {meta['seed']}",
        card.losses(s),
        card.agreement(s, "step (teacher-forced)", agree, "a chain (product)"),
    ]


def card_use(meta: dict, where: str) -> list[str]:
    """Its card's Use lines (``card.use_lines``): the run that picks the checkpoint at ``where``."""
    return ["```bash", f"python -m specbench method=mtp mtp.checkpoint={where} K={meta['drafter']['steps']}", "```", "",
            "`K` drafts that many tokens a step (one forward of the module each)."]
