"""A drafter checkpoint's card (README.md) and metadata (drafter.json): portable, and made from
the code's current defaults.

    python -m specbench.train.card [--check] [FOLDER ...]    (default: every folder under checkpoints/)

Training writes both (``write``). This command writes them again after the code's defaults
change (a tree size, a K); ``--check`` (run by the tests) exits 1 where a card is stale or
where either file names a path of the machine that trained it. Measurements of a checkpoint
are dated benchmarks and live in docs/benchmarks/drafters.md, not in its card.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shlex
import sys
from pathlib import Path

from specbench.paths import CONF_DIR

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = "docs/benchmarks/drafters.md"

# Settings that name files of the machine that trained (inputs cached there): never part of the
# data key, meaningless elsewhere. `out` is dropped from the command: its default is where the
# checkpoint is shipped (checkpoints/<target>/<name>).
LOCAL_SETTINGS = ("sources", "dir")
LOCAL_ARGS = ("features.sources", "features.dir", "data.dir", "out")
_ABS = re.compile(r"(?:^|[\s=:,(\['\"])((?:/|~/)[^\s/'\",)\]]+/[^\s'\",)\]]*)")


def absolute_paths(obj) -> list[str]:
    """Every absolute path (``/a/b``, ``~/a``) inside the strings of a JSON-like object."""
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in absolute_paths(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in absolute_paths(v)]
    return _ABS.findall(obj) if isinstance(obj, str) else []


def portable(meta: dict) -> dict:
    """``meta`` without what only the training machine knows: local input files and ``out``
    (also in the command). Raises ValueError if an absolute path is still left."""
    m = copy.deepcopy(meta)
    m.pop("measured", None)  # measurements are dated benchmarks: docs/benchmarks/drafters.md
    for section in ("feature_settings", "data_settings"):
        for key in LOCAL_SETTINGS:
            if key in (m.get(section) or {}):
                m[section][key] = None
    if m.get("command"):
        args = shlex.split(m["command"])
        keep = [a for a in args if a.split("=", 1)[0] not in LOCAL_ARGS]
        m["command"] = " ".join(shlex.quote(a) for a in keep)
    left = absolute_paths(m)
    if left:
        raise ValueError(f"drafter metadata names machine paths: {', '.join(sorted(set(left)))}")
    return m


def _where(folder: Path) -> str:
    try:
        return str(folder.resolve().relative_to(REPO))
    except ValueError:
        return "<this folder>"


def _method(name: str) -> dict:
    """Method ``name``'s default settings."""
    from omegaconf import OmegaConf

    from specbench import methods

    return OmegaConf.to_container(methods.settings(name))


def _builtin() -> list[str]:
    from specbench import methods

    return methods.builtin()


def use_lines(meta: dict, folder: Path) -> list[str]:
    """How a run picks this checkpoint, and the defaults it then runs with (read from the code
    and configs now, so a card never states an old tree size)."""
    where, kind = _where(folder), meta["kind"]
    lines = ["## Use", ""]
    if kind in ("eagle", "medusa", "specdec"):
        mconf = _method(kind)
        pick = f"method={kind}" + ("" if mconf.get("checkpoint") == where else f" {kind}.checkpoint={where}")
        lines += ["```bash", f"python -m specbench {pick}", "```", ""]
    elif kind == "eagle3":
        v = meta.get("drafter", {}).get("version", 3)
        lines += ["```bash", f"python -m specbench method=eagle eagle.version={v} eagle.checkpoint={where}", "```", ""]
    elif kind in ("dflash", "dspark"):
        pick = "" if _method(kind).get("checkpoint") == where else f" {kind}.checkpoint={where}"
        lines += ["```bash", f"python -m specbench method={kind}{pick}", "```", "",
                  f"Drafts with the block it was trained with; `{kind}.block_size=<B>` drafts with another."]
        if kind == "dspark":
            lines += ["`dspark.threshold=<c>` verifies a row's drafts up to the first slot whose confidence is below c."]
    elif kind == "peagle":
        lines += ["```bash", f"python -m specbench method=peagle peagle.checkpoint={where}", "```", "",
                  f"Drafts the {meta['drafter']['depths']} tokens a step it was trained for; `peagle.K=<k>` drafts k."]
    elif kind == "mtp":
        lines += ["```bash", f"python -m specbench method=mtp mtp.checkpoint={where} K={meta['drafter']['steps']}", "```", "",
                  "`K` drafts that many tokens a step (one forward of the module each)."]
    elif kind not in BODIES and kind in _builtin():  # a new kind, run by its namesake method
        lines += ["```bash", f"python -m specbench method={kind} {kind}.checkpoint={where}", "```", ""]
    if kind == "eagle":
        from specbench.methods.eagle import AUTO

        c, g = AUTO["cpu"], AUTO["cuda"]
        lines.append(f"Draft tree with `eagle.top_k`, `eagle.depth` and `eagle.total_tokens` at `auto` "
                     f"(methods/eagle.py): top_k {c['top_k']}, depth {c['depth']}, {c['total_tokens']} nodes "
                     f"verified on a CPU; top_k {g['top_k']}, depth {g['depth']}, {g['total_tokens']} nodes on a GPU.")
    elif kind == "medusa":
        from specbench.methods.medusa import AUTO_CPU_TREE
        from specbench.drafters.medusa import sparse_tree

        acc = meta.get("acc")

        def expected(n):
            if not acc:
                return ""
            e = sum(math.prod(acc[d][i] for d, i in enumerate(p)) for p in sparse_tree(acc, n))
            return f" (expected accepted drafts by the heads' held-out accuracies: {e:.2f})"

        own = int(meta["drafter"]["tree_size"])
        lines.append(f"{meta.get('heads')} heads; with `medusa.tree_size=auto` (methods/medusa.py) the sparse "
                     f"tree has {AUTO_CPU_TREE} nodes on a CPU{expected(AUTO_CPU_TREE)} and the checkpoint's "
                     f"{own} on a GPU{expected(own)}.")
    elif kind == "specdec":
        mconf = _method("specdec")
        lines.append(f"{meta['k']} draft tokens per forward (the checkpoint's queries; K above {meta['k']} is capped); "
                     f"verification `specdec.beta={mconf['beta']}` (1 = exact, lossless), `specdec.tol={mconf['tol']}`.")
    elif kind == "draft_lm":
        from omegaconf import OmegaConf

        drafts = [p.stem for p in sorted((CONF_DIR / "draft_model").glob("*.yaml"))
                  if OmegaConf.load(p).get("path") == where]
        pick = f"draft_model={drafts[0]}" if drafts else f"draft_model=smollm2-135m-draft draft_model.path={where}"
        from specbench.run.schema import Config

        k = Config.K
        lines += ["```bash", f"python -m specbench method=leviathan {pick}", "```", "",
                  f"Drafts K={k} tokens a step by default (`K=...`)."]
    return lines + [""]


def _losses(s: dict) -> str:
    """The final train loss and the held-out loss of a training summary ``s``."""
    return (f"- final train loss (last 20 steps): {s['train_loss_last20']:.3f}; held-out loss {s['eval_loss']:.3f} "
            f"({s['eval_sequences']} sequences)")


def _heads_body(meta: dict) -> list[str]:
    """The description, data and training sections of a card (``render`` adds the rest)."""
    s, d, fs, ts = meta["train_summary"], meta["data"], meta["feature_settings"], meta["train_settings"]
    what = {
        "eagle": "EAGLE feature-level drafter for `method=eagle`: fc([token embedding; target feature]) -> one "
                 "decoder layer -> the target's output layer restricted to the draft vocabulary",
        "medusa": f"{meta.get('heads')} Medusa heads for `method=medusa`: a residual SiLU block per head on the "
                  "target's last hidden state, then the target's output layer restricted to the draft vocabulary",
        "eagle3": "EAGLE-3 drafter for `method=eagle eagle.version=3`: fc([the target's states at the inputs of "
                  "layers 2, L//2, L-3]) -> one decoder layer over [embedding; feature] -> its own head over the "
                  "draft vocabulary (SafeAILab's EAGLE-3 layout)",
    }[meta["kind"]]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    per = "unrolled step (tree depth)" if meta["kind"] in ("eagle", "eagle3") else "head"
    lines = [
        f"# {meta['name']}: {meta['kind']} drafter for {meta['target']}", "",
        f"{what} ({meta['draft_vocab']} most frequent tokens of the feature set). Only the drafter's own weights "
        f"are stored ({s['trainable_params']:,} parameters, bf16); "
        + ("the embedding is the target's." if meta["kind"] == "eagle3" else
           "the embedding and output layer are the target's."),
        "", "## Data",
        f"- {d['sequences']} sequences of the ShareGPT training slice ({d['tokens']:,} token positions): "
        f"{d['answered']} first turns answered by the target itself (greedy, up to {fs['max_new_tokens']} tokens; "
        f"{d['answer_tokens']:,} answer tokens) and {d['sequences'] - d['answered']} whole conversations "
        f"(both roles, up to {fs['max_tokens']} tokens)",
        f"- dropped: {d['dropped']} (overlap with MT-Bench / HumanEval / GSM-Symbolic prompts, or a duplicate of "
        "the evaluation slice)",
        f"- stored per position: the target's hidden states at layers {fs['layers']} (fp16); feature set key {d['key']}",
        "", "## Training",
        f"- {s['steps']} steps, batch {ts['batch_size']} x up to {ts['seq_len']} tokens, AdamW lr {ts['lr']}, "
        f"seed {meta['seed']}, {s['train_seconds_this_run']:.0f} s",
        _losses(s),
        f"- held-out top-1 agreement with the target's greedy token, per {per}: {agree}",
    ]
    if meta.get("acc"):
        lines.append(f"- expected accepted drafts of the {meta['drafter']['tree_size']}-node tree it was trained "
                     f"for (product of per-rank accuracies): {s['tree_expected_accepted']:.2f}")
    return lines


def _draft_lm_body(meta: dict) -> list[str]:
    """The description, data and training sections of a card (``render`` adds the rest)."""
    s = meta["train_summary"]
    d = meta["data"]
    lines = [
        f"# {meta['name']}: a draft LM for {meta['target']}",
        "",
        f"A {meta['layers']}-layer causal LM with {meta['target']}'s tokenizer for `method=leviathan`: the target's "
        f"token embedding (shared, frozen), {meta['layers']} transformer layer(s) of its own (initialised from the "
        f"target's first layers), and the target's output layer restricted to the {meta['draft_vocab']} most "
        "frequent tokens of the distillation data.",
        "",
        "## Data",
        f"- {d['sequences']} ShareGPT first turns ({d['dropped_for_benchmark_overlap']} dropped for overlapping "
        f"MT-Bench / HumanEval / GSM prompts), {d['answered']} of them answered by the target itself "
        f"(greedy, up to {meta['data_settings']['max_new_tokens']} tokens)",
        f"- {d['tokens']} token positions with the target's top-{meta['data_settings']['topk']} distribution, "
        f"{d['response_tokens']} of them in the target's own answers",
        "",
        "## Training",
        f"- {s['steps']} steps, batch {meta['train_settings']['batch_size']} x up to "
        f"{meta['train_settings']['seq_len']} tokens, AdamW lr {meta['train_settings']['lr']}, seed {meta['seed']}",
        f"- trainable parameters: {s['trainable_params']:,}",
        f"- final train loss (soft cross-entropy, last 20 steps): {s['train_loss_last20']:.3f}; "
        f"KL to the teacher's top-k: {s['train_kl_last20']:.3f}",
        f"- held-out ({s['eval_sequences']} sequences): loss {s['eval_loss']:.3f}, KL {s['eval_kl']:.3f}, "
        f"top-1 agreement with the target {s['eval_top1_agreement']:.1%}",
        "",
    ]
    return lines


def _specdec_body(meta: dict) -> list[str]:
    """The description, data and training sections of a card (``render`` adds the rest)."""
    s, d, ds, ts = meta["train_summary"], meta["data"], meta["data_settings"], meta["train_settings"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_query_agreement"])
    lines = [
        f"# {meta['name']}: SpecDec Spec-Drafter for {meta['target']}", "",
        f"A non-autoregressive drafter for `method=specdec`: {meta['k']} learned [MASK] queries after the context "
        f"predict {meta['k']} draft tokens in one forward; the target's token embedding (shared, frozen), "
        f"{meta['layers']} transformer layer(s) of its own (initialised from the target's first layers), the "
        f"target's output layer restricted to the {meta['draft_vocab']} most frequent answer tokens. Only the "
        f"drafter's own weights are stored ({s['trainable_params']:,} parameters, bf16).",
        "", "## Data",
        f"- {s['train_sequences'] + s['eval_sequences']} ShareGPT training-slice first turns answered by the target "
        f"itself (greedy, up to {ds['max_new_tokens']} tokens; {d['dropped_for_benchmark_overlap']} prompts dropped "
        f"for overlapping MT-Bench / HumanEval / GSM prompts); distillation set key {d['key']}",
        f"- training cuts: {meta['drafter']['groups']} random cut points per answer per step",
        "", "## Training",
        f"- {s['steps']} steps, batch {ts['batch_size']} sequences, AdamW lr {ts['lr']}, seed {meta['seed']}, "
        f"{s['train_seconds_this_run']:.0f} s this run",
        f"- final train loss (last 20 steps): {s['train_loss_last20']:.3f}",
        f"- held-out ({s['eval_sequences']} answers, {s['eval_cuts']} cuts): top-1 agreement with the target's "
        f"greedy token per query: {agree}; tau of a greedy {meta['k']}-token chain: {s['eval_chain_tau']:.2f}",
    ]
    return lines


def _feature_data(meta: dict) -> list[str]:
    """The Data section of a drafter trained on the feature set (DFlash, DSpark, MTP, P-EAGLE)."""
    d, fs = meta["data"], meta["feature_settings"]
    return ["", "## Data",
            f"- {d['sequences']} sequences of the ShareGPT training slice ({d['tokens']:,} token positions): "
            f"{d['answered']} first turns answered by the target itself (greedy, up to {fs['max_new_tokens']} tokens) "
            f"and {d['sequences'] - d['answered']} whole conversations (up to {fs['max_tokens']} tokens); "
            f"dropped: {d['dropped']}; feature set key {d['key']}"]


def feature_meta(cfg, result: dict, target_name: str, data_meta: dict, command: str, **fields) -> dict:
    """The drafter.json of a drafter trained on the feature set by the block, MTP and P-EAGLE
    trainers: ``fields`` (its kind, vocabulary sizes), then its settings, data, training summary and
    command."""
    dr = cfg.drafter
    return {**fields, "seed": int(cfg.seed), "drafter": {k: dr[k] for k in dr}, "data": data_meta,
            "feature_settings": {k: cfg.features[k] for k in cfg.features},
            "train_settings": {k: cfg.train[k] for k in cfg.train}, "train_summary": result["summary"],
            "loss_curve_every_10_steps": result["loss_curve"], "command": command}


def _dflash_body(meta: dict) -> list[str]:
    """The description, data and training sections of a DFlash card (``render`` adds the rest)."""
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
        *_feature_data(meta),
        "", "## Training",
        f"- {s['steps']} steps, batch {ts['batch_size']} x up to {ts['seq_len']} tokens x {dr['anchors']} blocks, "
        f"AdamW lr {ts['lr']}, loss decay gamma {dr['gamma']}, layers initialised from the {dr.get('init')}, "
        f"seed {meta['seed']}; {s['trained_block_positions']:,} drafted positions seen",
        _losses(s),
        f"- held-out top-1 agreement with the target's greedy token, per block slot: {agree}; expected accepted "
        f"drafts a block (chain product): {s['eval_expected_accepted']:.2f}"
        + (" (teacher-forced: the Markov head reads the data's previous tokens, not its own drafts)" if dspark else ""),
    ]


def _mtp_body(meta: dict) -> list[str]:
    """The description, data and training sections of an MTP card."""
    s, ts, dr = meta["train_summary"], meta["train_settings"], meta["drafter"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    return [
        f"# {meta['name']}: MTP module for {meta['target']}", "",
        "A multi-token-prediction module for `method=mtp` (vLLM's speculators `mtp` layout): the embedding of the next "
        "token and the previous state, each normed, fused by `input_proj`, one decoder layer of the target's kind, a final "
        f"norm, the target's output layer; its normed output is fed back for the next draft. Only its own weights are "
        f"stored ({s['trainable_params']:,} parameters, bf16).",
        *_feature_data(meta),
        "", "## Training",
        f"- FastMTP's recipe: {dr['steps']} recursive steps, loss weights beta^k normalised (beta {dr['beta']}), soft "
        f"cross-entropy towards the target's distribution; {s['steps']} steps, batch {ts['batch_size']} x up to "
        f"{ts['seq_len']} tokens, AdamW lr {ts['lr']}, initialised from the {dr.get('init')}, seed {meta['seed']}",
        _losses(s),
        f"- held-out top-1 agreement with the target's greedy token, per step (teacher-forced): {agree}; expected "
        f"accepted drafts a chain (product): {s['eval_expected_accepted']:.2f}",
    ]


def _peagle_body(meta: dict) -> list[str]:
    """The description, data and training sections of a P-EAGLE card."""
    s, ts, dr = meta["train_summary"], meta["train_settings"], meta["drafter"]
    agree = ", ".join(f"{x:.1%}" for x in s["eval_top1_agreement"])
    return [
        f"# {meta['name']}: P-EAGLE drafter for {meta['target']}", "",
        "A parallel EAGLE-3 drafter for `method=peagle` (vLLM's speculators `peagle` layout): fc([the target's states "
        f"at the inputs of layers 2, L//2, L-3]) -> {dr['layers']} layers (EAGLE-3's first) over [embedding; feature], "
        f"mask slots (token {s['mask_token_id']}, a learned `mask_hidden` feature) drafting a step's {dr['depths']} "
        f"tokens in one forward -> its own head over {meta['draft_vocab']} draft tokens. Only its own weights are "
        f"stored ({s['trainable_params']:,} parameters, bf16); the embedding is the target's.",
        *_feature_data(meta),
        "", "## Training",
        f"- COD sampling (depth d keeps max({dr['down_sample']}^d, {dr['down_sample_min']}) of the chains), soft "
        f"cross-entropy towards the target's distribution; {s['steps']} steps, batch {ts['batch_size']} x up to "
        f"{ts['seq_len']} tokens, AdamW lr {ts['lr']}, seed {meta['seed']}",
        _losses(s),
        f"- held-out top-1 agreement with the target's greedy token, per depth (teacher-forced): {agree}; expected "
        f"accepted drafts a step (product): {s['eval_expected_accepted']:.2f}",
    ]


BODIES = {"peagle": _peagle_body, "mtp": _mtp_body, "dflash": _dflash_body, "dspark": _dflash_body, "eagle": _heads_body, "eagle3": _heads_body, "medusa": _heads_body, "draft_lm": _draft_lm_body, "specdec": _specdec_body}


def _plain_body(meta: dict) -> list[str]:
    """A kind without a card body of its own (a new one): its held-out scores as its trainer reports them."""
    s = meta.get("train_summary", {})
    return [f"# {meta['name']}: {meta['kind']} drafter for {meta['target']}", "",
            f"Trained {s.get('steps')} steps; held out: " + ", ".join(f"{k} {v}" for k, v in s.items() if k.startswith("eval_")),
            ""]


def render(meta: dict, folder: Path) -> str:
    """The card of a checkpoint whose (portable) metadata is ``meta``."""
    body = BODIES.get(meta["kind"], _plain_body)(meta)
    lines = [*body, *([""] if body[-1] != "" else []), *use_lines(meta, folder)]
    if meta.get("command"):
        lines += ["## Reproduce", "", "```bash", meta["command"], "```", ""]
    lines += ["## Measured", "", f"Benchmarks of the shipped checkpoints, dated and with their commands: `{BENCHMARKS}`.",
              ""]
    return "\n".join(lines)


def files(folder: Path, meta: dict) -> dict[str, str]:
    m = portable(meta)
    return {"drafter.json": json.dumps(m, indent=1, default=str) + "\n", "README.md": render(m, folder)}


def write(folder: Path, meta: dict) -> None:
    """Write a checkpoint's drafter.json and README.md (portable, from the current defaults)."""
    for name, text in files(Path(folder), meta).items():
        (Path(folder) / name).write_text(text)


def shipped() -> list[Path]:
    return sorted(p.parent for p in (REPO / "checkpoints").glob("*/*/drafter.json"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.train.card", description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, help="checkpoint folders (default: every one under checkpoints/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a card or drafter.json differs")
    a = ap.parse_args(argv)
    stale = []
    for folder in a.folders or shipped():
        try:
            meta = json.loads((folder / "drafter.json").read_text())
            want = files(folder, meta)
        except (OSError, ValueError, KeyError) as e:
            print(f"specbench.train.card: error: {folder}: {e}", file=sys.stderr)
            return 2
        for name, text in want.items():
            have = (folder / name).read_text() if (folder / name).exists() else None
            if have != text:
                stale.append(folder / name)
                if not a.check:
                    (folder / name).write_text(text)
    verb = "stale" if a.check else "written"
    for p in stale:
        print(f"{verb}: {p}")
    if a.check and stale:
        print("specbench.train.card: cards differ from the code's defaults; run `python -m specbench.train.card`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
