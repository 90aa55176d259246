"""The feature distillation set shared by every feature-level drafter (Medusa, EAGLE).

Sequences: whole ShareGPT conversations of the training slice (both roles, rendered with
the chat template, as EAGLE-1 trains), plus first turns answered by the target itself
(greedy, as Medusa-2 / EAGLE-3 self-distil). Any conversation whose text overlaps an
evaluation prompt (MT-Bench, HumanEval, GSM-Symbolic, the `sharegpt` set) is dropped; the
`sharegpt` set and the `ctx` filler come from another slice of the file altogether
(``specbench.run.data.SHAREGPT_EVAL``).

One teacher forward per sequence stores, per position, the target's hidden states at the
layers asked for (``final`` = after the final norm; EAGLE-3's low/mid/high layers by
index) in fp16. Logits are not stored: the frozen output layer recomputes them. Shards sit
in ``$SPECBENCH_CACHE/features/<target>-<key>``, keyed by the settings; an interrupted
pass resumes at the next missing shard. ``sources.pt`` (the token ids before answering)
is written first, so the pass can run on another machine without the data wheels
(``features.sources=<file>``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

import torch

from specbench.run import data as D
from specbench.decode.hidden import Tap
from specbench.paths import cache_dir
from specbench.train.distill import _norm, benchmark_texts, drop_overlap, pass_cost
from specbench.train.distill import load  # noqa: F401 - the shards


_NOT_KEYED = ("dir", "sources", "gen_bs", "teacher_bs")


def settings_key(target_name: str, fcfg, skip: tuple = ()) -> str:
    spec = {k: fcfg[k] for k in sorted(fcfg) if k not in _NOT_KEYED + skip}
    raw = json.dumps({"target": target_name, **spec}, sort_keys=True, default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:12]


def answers_key(target_name: str, fcfg) -> str:
    """What fixes a shard's token sequences: every setting but the layers stored."""
    return settings_key(target_name, fcfg, skip=("layers",))


def siblings_with_answers(root: Path, target_name: str, fcfg, made: dict) -> list[Path]:
    """Other feature sets of the same target, settings and way of answering (``made``: the dtype
    and chat rendering) that store other layers: their shards' answered sequences can be reused,
    so a new set of layers costs a teacher pass only. Each shard is checked item by item
    (``answers_of``) before its sequences are taken."""
    want, found = answers_key(target_name, fcfg), []
    for other in sorted(root.parent.glob(f"{target_name.replace('/', '_')}-*")):
        if other == root:
            continue
        for name in ("settings.json", "meta.json"):
            try:
                got = json.loads((other / name).read_text())
            except (OSError, ValueError):
                continue
            if (got.get("target") == target_name and got.get("made") == made
                    and answers_key(target_name, got.get("settings", {})) == want):
                found.append(other)
                break
    return found


def answers_of(donor: Path, name: str, part: list[dict]) -> list[torch.Tensor] | None:
    """The donor shard's sequences for ``part``, when it holds the same items (ids, answered or
    not, the same prompt tokens); else None."""
    try:
        done = torch.load(donor / name, weights_only=False, mmap=True)
    except FileNotFoundError:
        return None
    except Exception as e:  # a damaged shard: not used, said in one line
        print(f"specbench: feature set: {donor / name} unreadable ({type(e).__name__}); its answers are not reused",
              file=sys.stderr)
        return None
    if len(done) != len(part):
        return None
    for d, it in zip(done, part):
        n = len(it["tokens"])
        if (d["id"] != it["id"] or bool(d["answered"]) != bool(it["answer"]) or int(d["prompt_len"]) != n
                or not torch.equal(d["tokens"][:n], it["tokens"])):
            return None
    return [d["tokens"].clone() for d in done]


def eval_first_turns() -> set[str]:
    return {_norm(r["text"])[:160] for r in D._sharegpt_cache()["first_turns"]}


def sources(tokenizer, fcfg, chat: bool = True, convs: list[dict] | None = None) -> tuple[list[dict], dict]:
    """Token ids of every sequence before answering: ``respond`` first turns (to be answered
    by the target) then ``conversations`` whole conversations, from the training slice
    shuffled with the seed. Returns (items, counts of what was dropped)."""
    convs = D.sharegpt_training() if convs is None else convs
    bench, seen_eval = benchmark_texts(), eval_first_turns()
    order = list(range(len(convs)))
    random.Random(int(fcfg.seed)).shuffle(order)
    n_resp, n_conv = int(fcfg.respond), int(fcfg.conversations)
    items, dropped = [], {"benchmark_overlap": 0, "eval_slice_duplicate": 0}
    for i in order:
        if len(items) >= n_resp + n_conv:
            break
        turns = convs[i]["turns"]
        first = turns[0][1]
        if not 8 <= len(first) <= 6000:
            continue
        if _norm(first)[:160] in seen_eval:
            dropped["eval_slice_duplicate"] += 1
            continue
        if drop_overlap([t for _, t in turns[:2]], bench)[1]:
            dropped["benchmark_overlap"] += 1
            continue
        answer = len(items) < n_resp
        if answer:
            ids = D.render(tokenizer, [], first, chat)[: int(fcfg.max_prompt_tokens)]
        else:
            ids = render_conversation(tokenizer, turns, chat)[: int(fcfg.max_tokens)]
        if len(ids) >= 4:
            items.append({"id": convs[i]["id"], "tokens": torch.tensor(ids, dtype=torch.int32), "answer": answer})
    return items, dropped


def render_conversation(tokenizer, turns, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        msgs = [{"role": r, "content": t} for r, t in turns]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer("\n\n".join(t for _, t in turns))["input_ids"]


@torch.inference_mode()
def teacher_hidden(model, seqs: list[torch.Tensor], layers, device) -> list[dict]:
    """Right-padded forward; per sequence {layer: [L, d] fp16}."""
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s.long()
        mask[b, : len(s)] = 1
    with Tap(model, layers) as tap:
        model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=1)
        got = tap.take()
    return [{str(k): got[k][b, : len(s)].to(torch.float16).cpu() for k in layers} for b, s in enumerate(seqs)]


def layer_names(fcfg) -> list:
    return [x if x == "final" else int(x) for x in fcfg.layers]


def build(target, tokenizer, target_name: str, fcfg, device, dtype, chat: bool = True, progress: bool = True,
          convs: list[dict] | None = None) -> Path:
    """Make (or resume) the feature set; returns its folder of shards."""
    from tqdm.auto import tqdm

    from specbench.methods.ar import AR
    from specbench.decode.engine import Engine
    from specbench.hf import eos_ids
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    key = settings_key(target_name, fcfg)
    root = Path(fcfg.get("dir") or cache_dir() / "features") / f"{target_name.replace('/', '_')}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    src_path = Path(str(fcfg.sources)) if fcfg.get("sources") else root / "sources.pt"
    if src_path.exists():
        src = torch.load(src_path, weights_only=False)
    else:
        items, dropped = sources(tokenizer, fcfg, chat, convs)
        src = {"items": items, "dropped": dropped}
        tmp = src_path.with_suffix(f".tmp{os.getpid()}")
        torch.save(src, tmp)
        tmp.rename(src_path)
    items = src["items"]
    made = {"dtype": str(dtype).replace("torch.", ""), "chat": bool(chat)}
    (root / "settings.json").write_text(json.dumps({"target": target_name, "made": made,
                                                   "settings": {k: fcfg[k] for k in fcfg}}, indent=1, default=str))
    donors = siblings_with_answers(root, target_name, fcfg, made)
    answers_from = {}
    layers = layer_names(fcfg)
    shard = int(fcfg.shard_size)
    n_shards = (len(items) + shard - 1) // shard
    eos = eos_ids(target, tokenizer)
    todo = [it for si in range(n_shards) if not (root / f"shard_{si:04d}.pt").exists()
            for it in items[si * shard:(si + 1) * shard]]
    if todo:
        answers, max_new = sum(bool(it["answer"]) for it in todo), int(fcfg.max_new_tokens)
        print(pass_cost(target, device, "feature set", answers, max_new, int(fcfg.gen_bs),
                        sum(len(it["tokens"]) for it in todo) + answers * max_new, logits=False)
              + (" (less where a set of other layers holds the answers)" if donors else ""), file=sys.stderr)
    bar = tqdm(total=len(items), desc="feature set", unit="seq", disable=not progress, file=sys.stderr)
    for si in range(n_shards):
        path = root / f"shard_{si:04d}.pt"
        part = items[si * shard:(si + 1) * shard]
        if path.exists():
            bar.update(len(part))
            continue
        seqs = [it["tokens"] for it in part]
        ans = [j for j, it in enumerate(part) if it["answer"]]
        for donor in donors:
            reused = answers_of(donor, path.name, part)
            if reused is not None:
                seqs, ans = reused, []
                answers_from[path.name] = donor.name
                break
        gen = torch.Generator(device).manual_seed(int(fcfg.seed) + si)
        for s in range(0, len(ans), int(fcfg.gen_bs)):
            rows = ans[s:s + int(fcfg.gen_bs)]
            eng = Engine(target, AR(None, target, tokenizer, device, dtype), Sampling(float(fcfg.temperature)),
                         device, dtype, eos, PhaseTimer(device))
            outs = eng.generate([seqs[j].tolist() for j in rows], int(fcfg.max_new_tokens), gen)
            for j, r in zip(rows, outs):
                seqs[j] = torch.cat([seqs[j], torch.tensor(r.tokens, dtype=torch.int32)])
        order = sorted(range(len(seqs)), key=lambda j: len(seqs[j]))  # similar lengths share a batch
        hidden = [None] * len(seqs)
        for s in range(0, len(order), int(fcfg.teacher_bs)):
            rows = order[s:s + int(fcfg.teacher_bs)]
            for j, h in zip(rows, teacher_hidden(target, [seqs[j] for j in rows], layers, device)):
                hidden[j] = h
        out = [{"id": it["id"], "tokens": sq, "prompt_len": len(it["tokens"]), "answered": it["answer"], "hidden": h}
               for it, sq, h in zip(part, seqs, hidden)]
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(out, tmp)
        tmp.rename(path)  # a shard is either whole or absent
        bar.update(len(part))
    bar.close()
    if answers_from:
        print(f"specbench: feature set: the answers of {len(answers_from)} shard(s) come from "
              f"{', '.join(sorted(set(answers_from.values())))} (the same sequences, other layers)", file=sys.stderr)
    prev = json.loads((root / "meta.json").read_text()).get("answers_from", {}) if (root / "meta.json").exists() else {}
    meta = {"target": target_name, "key": key, "made": made, "answers_from": prev | answers_from,
            "settings": {k: fcfg[k] for k in fcfg}, "sequences": len(items),
            "dropped": src["dropped"], "shards": n_shards}
    (root / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    return root


def stats(items: list[dict]) -> dict:
    tok = sum(len(it["tokens"]) for it in items)
    resp = sum(len(it["tokens"]) - it["prompt_len"] for it in items if it["answered"])
    return {"sequences": len(items), "tokens": tok, "answer_tokens": resp,
            "answered": sum(1 for it in items if it["answered"])}
