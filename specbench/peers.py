"""`make bench-peers`: specbench's engine against Hugging Face transformers' own decoding on
the same prompts, model, dtype and machine, in one run (alternating runs per prompt so the
machine's drift hits both sides alike).

- ar   vs model.generate (bs=1 and bs=8): tokens/s ratio and token identity;
- pld  vs generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=n): ratio, identity, tau of both;
- leviathan vs generate(assistant_model=draft) with a constant K: ratio, identity, tau of both;
- engine overhead: generation time outside model forwards, at bs=1;
- for pld and leviathan, how often each side's output equals its own AR's at bs=1: 100% for both
  in fp32; in bf16, where a verify forward rounds differently from a decode step, it tells
  whether a mismatch between the sides is that rounding (both leave their AR alike) or a bug.

Ends with one JSON line holding the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from omegaconf import OmegaConf

from specbench.methods.ar import AR
from specbench.methods.leviathan import Leviathan
from specbench.methods.pld import PromptLookup
from specbench.run import data as D
from specbench import kernels
from specbench.decode.engine import Engine
from specbench.errors import ConfigError
from specbench.hf import eos_ids
from specbench.models import load_model, load_tokenizer, resolve_device, resolve_dtype, self_layers_draft
from specbench.paths import CONF_DIR
from specbench.decode.timing import PhaseTimer, sync
from specbench.decode.verify import Sampling


class ForwardCounter:
    def __init__(self, module):
        self.n = 0
        self.h = module.register_forward_pre_hook(self._inc)

    def _inc(self, *_):
        self.n += 1

    def close(self):
        self.h.remove()


def strip(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def hf_generate(model, tok, prompts, max_new, eos, **kw):
    """Left-padded batch through model.generate, greedy; returns token lists and seconds."""
    P = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    dev = model.device
    sync(dev)
    t = time.perf_counter()
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=sorted(eos), pad_token_id=pad, **kw)
    sync(dev)
    dt = time.perf_counter() - t
    return [strip(row[P:].tolist(), eos) for row in out], dt


def ours(model, proposer, prompts, max_new, eos, device, dtype):
    timer = PhaseTimer(device)
    eng = Engine(model, proposer, Sampling(), device, dtype, eos, timer)
    with timer.watching([model, *proposer.modules()]):
        sync(device)
        t = time.perf_counter()
        res = eng.generate(prompts, max_new)
        sync(device)
        dt = time.perf_counter() - t
    fwd = timer.totals().get("forward", 0.0)
    steps = sum(r.steps for r in res)
    acc = sum(sum(r.accept_lens) for r in res)
    return [r.tokens for r in res], dt, fwd, steps, acc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=10, help="prompts per dataset (MT-Bench first turns, HumanEval)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=4,
                    help="draft = the target's first n layers (an HF model, as assisted generation needs)")
    ap.add_argument("--bs", default="1,8", help="batch sizes for the AR comparison")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="one or a comma list (fp32,bf16): each runs every comparison")
    ap.add_argument("--kernel", default="auto", help="linear-layer path of the model both sides run (specbench.kernels)")
    ap.add_argument("--out", default=None, help="also write the JSON line here")
    a = ap.parse_args(argv)

    device = resolve_device(a.device)
    try:
        kernel = kernels.resolve(a.kernel, device)
        dtypes = [resolve_dtype(d, device) for d in a.dtype.split(",")]
    except ConfigError as e:
        ap.error(str(e))
    for dtype in dtypes:
        run(a, device, dtype, kernel)
    return 0


def _own(r: dict) -> str:
    """"ours% / HF%": how often each side's output equals its own AR at bs=1 ("-" for AR rows)."""
    if r["ours_as_own_ar"] is None:
        return "-"
    return f"{r['ours_as_own_ar']:.0%} / {r['hf_as_own_ar']:.0%}"


def run(a, device, dtype, kernel: str) -> dict:
    """Every comparison in one dtype; prints the table and the JSON line."""
    mcfg = OmegaConf.load(CONF_DIR / "model" / f"{a.model}.yaml")
    model = load_model(mcfg, device, dtype)
    kernels.apply(model, kernel)  # both sides run the same kernels: the engine is what differs
    tok = load_tokenizer(mcfg)
    eos = eos_ids(model, tok)
    chat = bool(mcfg.get("chat", True))
    qs = D.mt_bench()[: a.limit] + D.humaneval()[: a.limit]
    prompts = [D.render(tok, [], q.turns[0], chat) for q in qs]
    cfg = OmegaConf.create({"K": a.K, "method": {"name": "pld", "max_ngram": a.ngram, "min_ngram": 1},
                            "draft_model": {"name": "self_layers", "layers": a.draft_layers}})
    draft, draft_name = self_layers_draft(model, a.draft_layers), f"self_layers:{a.draft_layers}"
    print(f"[peers] {a.model} {dtype} ({kernel} linears) on {device}, {len(prompts)} prompts x {a.max_new} new tokens",
          file=sys.stderr)

    # warm both paths up (untimed)
    ours(model, AR(cfg, model, tok, device, dtype), prompts[:1], 8, eos, device, dtype)
    hf_generate(model, tok, prompts[:1], 8, eos)

    result = {"model": a.model, "device": str(device), "dtype": str(dtype).replace("torch.", ""), "kernel": kernel,
              "prompts": len(prompts), "max_new_tokens": a.max_new, "K": a.K, "ngram": a.ngram,
              "draft": draft_name}
    rows = []
    own_ar = {}  # side -> each prompt's AR output at bs=1: what a lossless method should reproduce

    def compare(label, batches, make_ours, hf_kwargs, tau=True, keep=None):
        """One comparison; ``keep``: a dict that takes each side's outputs (the AR at bs=1 that
        the lossless methods' rows, those with tau, are then held against)."""
        t_o = t_h = fwd = 0.0
        n_o = n_h = same = steps_o = acc_o = fwd_h = 0
        total = 0
        outs = {"ours": [], "hf": []}
        from tqdm.auto import tqdm

        for i, batch in enumerate(tqdm(batches, desc=label, file=sys.stderr)):
            counter = ForwardCounter(model)
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for side in order:
                if side == 0:
                    o_toks, dt, f, st, ac = ours(model, make_ours(), batch, a.max_new, eos, device, dtype)
                    t_o += dt
                    fwd += f
                    steps_o += st
                    acc_o += ac
                else:
                    before = counter.n
                    h_toks, dth = hf_generate(model, tok, batch, a.max_new, eos, **hf_kwargs)
                    t_h += dth
                    fwd_h += counter.n - before - 1  # decoding forwards (prefill excluded)
            counter.close()
            n_o += sum(len(x) for x in o_toks)
            n_h += sum(len(x) for x in h_toks)
            same += sum(x == y for x, y in zip(o_toks, h_toks))
            total += len(batch)
            outs["ours"] += o_toks
            outs["hf"] += h_toks
        if keep is not None:
            keep.update(outs)
        # In fp32 both sides reproduce their own AR exactly. In bf16 a verify forward's shapes
        # differ from AR's and so does the rounding: "identical" (ours vs HF) then falls for both
        # sides alike if each stays as close to its own AR as the other does.
        own = {side: sum(x == y for x, y in zip(outs[side], own_ar[side])) / total if tau and own_ar else None
               for side in outs}
        r = {"ours_tok_s": n_o / t_o, "hf_tok_s": n_h / t_h, "ratio": (n_o / t_o) / (n_h / t_h),
             "identical": same / total, "engine_overhead": (t_o - fwd) / t_o,
             "tau_ours": (n_o - total) / steps_o if steps_o and tau else None,
             "tau_hf": (n_h - total) / fwd_h if fwd_h and tau else None,
             "ours_as_own_ar": own["ours"], "hf_as_own_ar": own["hf"]}
        rows.append((label, r))
        return r

    for bs in [int(x) for x in a.bs.split(",")]:
        batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
        result[f"ar_bs{bs}"] = compare(f"ar bs={bs}", batches, lambda: AR(cfg, model, tok, device, dtype), {},
                                      tau=False, keep=own_ar if bs == 1 else None)
    singles = [[p] for p in prompts]
    result["pld"] = compare("pld bs=1", singles, lambda: PromptLookup(cfg, model, tok, device, dtype),
                            {"prompt_lookup_num_tokens": a.K, "max_matching_ngram_size": a.ngram})
    result["leviathan"] = compare(
        "leviathan bs=1", singles, lambda: Leviathan(cfg, model, tok, device, dtype, draft_model=draft),
        {"assistant_model": draft, "num_assistant_tokens": a.K, "num_assistant_tokens_schedule": "constant",
         "assistant_confidence_threshold": 0.0})

    print(f"\n{result['dtype']}, kernel={kernel}")
    print(f"{'comparison':<16}{'ours tok/s':>11}{'HF tok/s':>10}{'ratio':>8}{'identical':>11}{'tau ours':>10}"
          f"{'tau HF':>8}{'overhead':>10}{'= own AR (ours/HF)':>20}")
    for label, r in rows:
        tau_o = "-" if r["tau_ours"] is None else f"{r['tau_ours']:.2f}"
        tau_h = "-" if r["tau_hf"] is None else f"{r['tau_hf']:.2f}"
        print(f"{label:<16}{r['ours_tok_s']:>11.2f}{r['hf_tok_s']:>10.2f}{r['ratio']:>7.2f}x{r['identical']:>10.0%}"
              f"{tau_o:>10}{tau_h:>8}{r['engine_overhead']:>10.1%}{_own(r):>20}")
    summary = {"bench": "peers", **{k: v for k, v in result.items() if not isinstance(v, dict)},
               **{f"{k}_ratio": round(v["ratio"], 4) for k, v in result.items() if isinstance(v, dict)},
               **{f"{k}_identical": v["identical"] for k, v in result.items() if isinstance(v, dict)},
               "engine_overhead_bs1": round(result["ar_bs1"]["engine_overhead"], 4) if "ar_bs1" in result else None,
               "tau": {k: [v["tau_ours"], v["tau_hf"]] for k, v in result.items()
                       if isinstance(v, dict) and k in ("pld", "leviathan")},
               "as_own_ar": {k: [v["ours_as_own_ar"], v["hf_as_own_ar"]] for k, v in result.items()
                             if isinstance(v, dict) and k in ("pld", "leviathan")},
               "detail": {k: v for k, v in result.items() if isinstance(v, dict)}}
    line = json.dumps(summary)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    sys.exit(main())
