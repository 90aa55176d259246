"""REST: retrieval-based speculative decoding (He et al. 2023, arXiv 2311.08252).

A datastore of token sequences is indexed once into suffix arrays (``specbench.suffix_index``)
and cached in ``$SPECBENCH_CACHE/rest``. Per step and row, the longest suffix of the context
(``max_suffix`` down to ``min_suffix`` tokens) that occurs in the datastore retrieves its
continuations; the ``num_draft`` most frequent trie nodes of them (the paper's top-64) are the
row's draft tree. Ties are broken the same way every time (the REST authors' library breaks
them by a hash map's order), so the same job gives the same drafts.
Candidates are deterministic: greedy match, or under sampling the lossless rule with a
one-hot q per node (each child tried against the residual of its parent), never REST's
reference per-path sampling.

Datastores: ``sharegpt`` (assistant turns of the ShareGPT training slice, never the
evaluation slice), ``python_code`` (the Python standard library's own source, as the
paper's code datastore; no HumanEval solution is in it), or a path to a ``.txt`` file
(one entry) or ``.jsonl`` file (one entry per line: its ``text`` field, else every string
value).
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib
import json
from pathlib import Path
import shutil
import sys
import sysconfig
from typing import Any

import torch

from specbench.methods.base import BatchState, Proposer
from specbench import suffix_index
from specbench.decode.tree import Draft
from specbench.errors import ConfigError
from specbench.hf import text_config
from specbench.paths import cache_dir, file_lock, resolve_path

BUILTIN = ("sharegpt", "python_code")
MAX_VOCAB = suffix_index.MAX_TOKENS - 1  # ids are stored as int32 (id + 1)
# num_draft by device (`auto`): the paper's 64 trie nodes on a GPU, where a 64-node verify costs
# about one token; on a CPU every node costs: 7 nodes and the root, two passes of the native kernel
# (docs/tuning.md).
AUTO_NUM_DRAFT = {"cuda": 64, "cpu": 7}
TUNE_NUM_DRAFT = {"cuda": [16, 32, 64, 96], "cpu": [2, 4, 7, 12, 20]}  # what K=auto chooses among


def _datastore_path(spec: str) -> Path | None:
    return None if spec in BUILTIN else Path(resolve_path(spec)).expanduser()


def python_sources() -> list[Path]:
    """The standard library's .py files (tests and bundled third-party code left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def corpus(spec: str):
    """Yields the texts of a datastore (one entry each)."""
    if spec == "sharegpt":
        from specbench.run import data as D

        for conv in D.sharegpt_training():
            for role, text in conv["turns"]:
                if role == "assistant":
                    yield text
    elif spec == "python_code":
        for p in python_sources():
            yield p.read_text(encoding="utf-8", errors="replace")
    else:
        path = _datastore_path(spec)
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if isinstance(row, dict):
                        yield row["text"] if isinstance(row.get("text"), str) else \
                            "\n".join(v for v in row.values() if isinstance(v, str))
                    elif isinstance(row, str):
                        yield row
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def datastore_key(spec: str, tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    src = spec
    path = _datastore_path(spec)
    if path is not None:
        st = path.stat()
        src = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    elif spec == "python_code":
        src = f"{spec}:{sysconfig.get_paths()['stdlib']}:{sys.version_info[:2]}"
    return hashlib.sha1(f"{src}|{vocab}".encode()).hexdigest()[:12]


def build_datastore(spec: str, tokenizer, vocab_size: int, progress: bool = True) -> Path:
    """The cached index folder of ``spec`` for this tokenizer (built once, under a file lock)."""
    from tqdm.auto import tqdm

    name = spec if spec in BUILTIN else "file-" + _datastore_path(spec).stem
    out = cache_dir() / "rest" / f"{name}-{datastore_key(spec, tokenizer)}.sa"
    if out.is_dir():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(out.name + ".lock")):
        if out.is_dir():
            return out
        for stale in out.parent.glob(f"{out.name}.tmp*"):  # a killed build's leftovers (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)

        def entries():
            bar = tqdm(desc=f"REST datastore {spec}", unit="entry", disable=not progress, file=sys.stderr)
            texts = corpus(spec)
            while True:  # tokenized in batches (a fast tokenizer encodes a batch in parallel)
                chunk = [t for _, t in zip(range(256), texts)]
                if not chunk:
                    break
                for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]:
                    if len(ids) >= 2:
                        yield ids
                bar.update(len(chunk))
            bar.close()

        if suffix_index.build(entries(), out) == 0:
            raise ConfigError(f"rest.datastore '{spec}' has no text to index")
    return out


class Rest(Proposer):
    name = "rest"

    @dataclass
    class Settings:  # `rest.<key>=...` is short for `method.<key>=...`
        name: str = "rest"
        datastore: str = "sharegpt"  # sharegpt | python_code | a .txt / .jsonl path (built once into $SPECBENCH_CACHE/rest)
        num_draft: Any = "auto"  # trie nodes verified per step (auto: the paper's 64 on CUDA, 7 on CPU)
        max_suffix: int = 16  # longest context suffix searched first ...
        min_suffix: int = 2  # ... down to this many tokens
    cost_kind = "ngram"

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        spec = str(m.datastore)
        path = _datastore_path(spec)
        if path is not None and not path.is_file():
            raise ConfigError(f"rest.datastore '{spec}' is neither {' nor '.join(BUILTIN)} nor an existing "
                              ".txt/.jsonl file")
        # a 1-token suffix matches nearly everywhere; one node is not a tree
        for key, lo in (("num_draft", 2), ("max_suffix", 2), ("min_suffix", 2)):
            v = m[key]
            if key == "num_draft" and v == "auto":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                what = "'auto' or an integer" if key == "num_draft" else "an integer"
                raise ConfigError(f"rest.{key} must be {what} >= {lo}, got {v!r}")
        if m.min_suffix > m.max_suffix:
            raise ConfigError(f"rest.min_suffix ({m.min_suffix}) must not exceed rest.max_suffix ({m.max_suffix})")
        V = getattr(text_config(target_config), "vocab_size", 0) or 0
        if V > MAX_VOCAB:
            raise ConfigError(f"rest: the target's vocabulary ({V} tokens) is too large for the datastore's 32-bit "
                              f"tokens (at most {MAX_VOCAB}); use another method for this model")

    @classmethod
    def draft_label(cls, cfg) -> str:
        return f"datastore:{cfg.method.datastore}"

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the trie nodes verified per step (num_draft)."""
        return [{"method.num_draft": n} for n in TUNE_NUM_DRAFT.get(device.type, TUNE_NUM_DRAFT["cpu"])]

    @classmethod
    def spec_len(cls, cfg, device) -> None:
        return None  # the datastore's continuations set each path's length; cfg.K plays no part

    @classmethod
    def reach(cls, cfg, device) -> int:
        m = cfg.method  # at most num_draft nodes: a chain of them at worst
        return int(AUTO_NUM_DRAFT.get(device.type, AUTO_NUM_DRAFT["cpu"]) if m.num_draft == "auto" else m.num_draft)

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        """A datastore of random text in the tiny vocabulary (some of its n-grams recur)."""
        g = torch.Generator().manual_seed(0)
        words = torch.randint(3, len(tokenizer), (40, 30), generator=g) % 24 + 3
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "rest.txt").write_text("\n".join(tokenizer.decode(w.tolist()) for w in words))
        return {"method": {"datastore": str(folder / "rest.txt"), "num_draft": 8, "max_suffix": 6}}

    def __init__(self, cfg, target, tokenizer, device, dtype, index=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.spec = str(m.datastore)
        nd = AUTO_NUM_DRAFT.get(device.type, AUTO_NUM_DRAFT["cpu"]) if m.num_draft == "auto" else m.num_draft
        self.num_draft, self.max_suffix, self.min_suffix = int(nd), int(m.max_suffix), int(m.min_suffix)
        if self.min_suffix < 2 or self.num_draft < 2:
            raise ValueError("rest: min_suffix and num_draft must be >= 2")
        if index is None:
            V = int(text_config(target.config).vocab_size)
            index = suffix_index.SuffixIndex(build_datastore(self.spec, tokenizer, V,
                                                             progress=bool(cfg.get("progress", True))))
        self.index = index

    def retrieve(self, seq: list[int]) -> tuple[list[int], list[int]]:
        """The draft trie (tokens, parents) from the longest suffix of ``seq`` found."""
        return self.index.drafts(seq, self.max_suffix, self.min_suffix, self.num_draft)

    def propose(self, state: BatchState) -> Draft | None:
        trees = [self.retrieve(s) for s in state.seqs]
        return Draft.from_trees([t for t, _ in trees], [p for _, p in trees], state.device)

    def describe(self) -> dict:
        return {"datastore": self.spec, "num_draft": self.num_draft, "max_suffix": self.max_suffix,
                "min_suffix": self.min_suffix,
                "search": "suffix-array"}  # specbench.suffix_index (records before 2026-11-27: draftretriever 0.1.1)
