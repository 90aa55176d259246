"""DSpark's drafter (DeepSeek, arXiv 2607.05147): DFlash's block drafter (``drafters/dflash.py``)
with two small heads on its normed block states h_k.

A Markov head adds a bias to slot k's logits from the token before it, so the drafts of one block
depend on each other again (a pure block drafter's slots are independent given the context):

    logits_k = head(h_k) + bias_k,   prev_0 = x_p (the anchor token), prev_k = the draft of slot k-1
    vanilla  bias_k = W2 W1[prev_k]
    gated    bias_k = W2 (sigmoid(gate([h_k ; W1[prev_k]])) * W1[prev_k])
    rnn      [g ; c ; o] = joint([s_{k-1} ; W1[prev_k] ; h_k]),  s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c),
             bias_k = W2 tanh(o),  s_{-1} = 0

W1 embeds target token ids (rank r), W2 maps to the head's vocabulary. Drafting is sequential over
the slots but cheap: one forward of the draft layers, then a vector op per slot.

A confidence head predicts each slot's acceptance given the slots before it were accepted:
``sigmoid(proj([h_k ; W1[prev_k]]))`` (or of h_k alone); trained towards 1 - TV(draft, target) of
the slot. The method verifies a row's drafts up to the first slot whose confidence is below a
threshold (``methods/dspark.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from specbench.drafters.dflash import DFlashDrafter

MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, out_vocab: int, rank: int, kind: str, hidden_size: int):
        super().__init__()
        if kind not in MARKOV_TYPES:
            raise ValueError(f"markov head type must be one of {MARKOV_TYPES}, got {kind!r}")
        if rank <= 0:
            raise ValueError(f"markov rank must be > 0, got {rank}")
        self.kind, self.rank = kind, int(rank)
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [...] target ids -> [..., r]."""
        return self.markov_w1(prev)

    def step(self, prev, h, state=None):
        """Slot k's bias [B, V'] from the token before it ``prev`` [B] and its state ``h`` [B, d];
        ``state``: the rnn head's s_{k-1} (None at slot 0). Returns (bias, state)."""
        e = self.embed(prev)
        if self.kind == "vanilla":
            return self.markov_w2(e), None
        h = h.to(e.dtype)
        if self.kind == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e), None
        state = torch.zeros_like(e) if state is None else state
        g, c, o = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return self.markov_w2(torch.tanh(o)), g * state + (1.0 - g) * torch.tanh(c)

    def teacher_forced(self, prev, h):
        """Training: the biases [..., n, V'] of n slots whose previous tokens ``prev`` [..., n] are known."""
        if self.kind != "rnn":
            return self.step(prev, h)[0]
        out, state = [], None
        for k in range(prev.shape[-1]):
            bias, state = self.step(prev[..., k], h[..., k, :], state)
            out.append(bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x):
        return self.proj(x).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    kind = "dspark"

    def __init__(self, target, config, layer_ids, block_size: int, mask_token_id: int, anchor: str = "next",
                 draft_vocab: int | None = None, own_embedding: bool = False, markov_rank: int = 256,
                 markov_type: str = "vanilla", confidence: bool = True, confidence_with_markov: bool = True):
        """DFlash's arguments, and the heads: ``markov_rank`` 0 has no Markov head; ``confidence``
        a confidence head, over [h ; W1[prev]] when ``confidence_with_markov``."""
        super().__init__(target, config, layer_ids, block_size, mask_token_id, anchor, draft_vocab, own_embedding)
        if confidence and confidence_with_markov and not markov_rank:
            raise ValueError("a confidence head over the Markov embedding needs a Markov head (markov_rank > 0)")
        d = int(config.hidden_size)
        self.markov_head = (MarkovHead(self.vocab_size, draft_vocab or self.vocab_size, int(markov_rank), markov_type, d)
                            if markov_rank else None)
        self.confidence_with_markov = bool(confidence and confidence_with_markov)
        self.confidence_head = (ConfidenceHead(d + (int(markov_rank) if self.confidence_with_markov else 0))
                                if confidence else None)

    def confidence(self, h, prev):
        """Confidence logits of slots with states ``h`` [..., d] and previous tokens ``prev`` [...]."""
        if self.confidence_with_markov:
            h = torch.cat([h, self.markov_head.embed(prev).to(h.dtype)], -1)
        return self.confidence_head(h)

    def draft(self, h, first, pick=None):
        """Drafts of a block's normed states ``h`` [B, B_slots, d], ``first`` [B] the anchor token,
        slot by slot: ``pick(logits)`` -> (ids, q) chooses each slot's draft from its logits over the
        head's vocabulary (None: the argmax). Returns target ids [B, drafts], the confidence logits
        [B, drafts] (None without a confidence head) and the q ``pick`` gave [B, drafts, ...] (None
        for argmax drafts). With the ``bonus`` anchor slot 0 drafts nothing, but an rnn head's state
        runs through it (prev = the anchor token), as speculators trains it."""
        state = None
        if self.anchor == "bonus":
            if self.markov_head is not None and self.markov_head.kind == "rnn":
                state = self.markov_head.step(first, h[:, 0])[1]
            h = h[:, 1:]
        base = self.logits(h)  # [B, n, V'] (the head's vocabulary)
        vocab = self.vocab_ids if self.lm_head is not None else None
        prev, ids, conf, qs = first, [], [], []
        for k in range(h.shape[1]):
            logits = base[:, k]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev, h[:, k], state)
                logits = logits + bias.to(logits.dtype)
            if self.confidence_head is not None:
                conf.append(self.confidence(h[:, k], prev))
            tok, q = (logits.argmax(-1), None) if pick is None else pick(logits)
            prev = tok if vocab is None else vocab[tok]
            ids.append(prev)
            qs.append(q)
        return (torch.stack(ids, 1), torch.stack(conf, 1).float() if conf else None,
                None if pick is None else torch.stack(qs, 1))

    def train_logits(self, h, prev):
        """Training: logits [..., n, V'] and confidence logits [..., n] (or None) of slots with
        states ``h`` [..., n, d] whose previous tokens ``prev`` [..., n] are the data's (slot 0
        first: with the ``bonus`` anchor, pass the anchor slot too; its outputs draft nothing)."""
        logits = self.logits(h)
        if self.markov_head is not None:
            logits = logits + self.markov_head.teacher_forced(prev, h).to(logits.dtype)
        return logits, (self.confidence(h, prev) if self.confidence_head is not None else None)
