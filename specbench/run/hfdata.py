"""Prompt sets read through Hugging Face ``datasets`` (imported here only, and only when asked):
``dataset=hf``, any set ``datasets`` opens (a hub id, a ``save_to_disk`` folder, a folder of data
files or a hub snapshot, or parquet / json / jsonl / csv files) with its columns named by the user,
and ``dataset=speed_bench``, NVIDIA's SPEED-Bench from the files its users download or prepare.

SPEED-Bench's layout, from its dataset card (huggingface.co/datasets/nvidia/SPEED-Bench) and the
loader of NVIDIA's measurement framework (github.com/NVIDIA/Model-Optimizer,
examples/specdec_bench/specdec_bench/datasets/speed.py): six configs, ``qualitative`` (880 questions,
11 categories) and ``throughput_1k``, ``_2k``, ``_8k``, ``_16k``, ``_32k`` (1,536 each, by input
length), each one split ``test`` with columns ``question_id``, ``category``, ``sub_category``,
``turns`` (a list of strings), ``source``, ``src_id``, ``difficulty``, ``multiturn``. The hub copy
leaves the turns of licensed sources as a placeholder; the framework's ``prepare_data.py`` fetches
them and writes ``<output_dir>/speed/<config>/test.parquet``."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from specbench.errors import ConfigError, did_you_mean

# what ``datasets`` reads each data file with, by suffix (compressed files by the suffix before)
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip")
SPEED_SPLITS = ("qualitative", "throughput_1k", "throughput_2k", "throughput_8k", "throughput_16k", "throughput_32k")
SPEED_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"


def builder(path: str | Path) -> str | None:
    """The ``datasets`` builder for a data file (or glob) by its suffix; None for anything else."""
    suffixes = [s.lower() for s in Path(str(path)).suffixes]
    while suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def is_local(path: str) -> bool:
    """A path on this machine (else a hub id): it exists, reads as one (/, ., ~) or names a data file."""
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or builder(path) is not None


def _saved(p: Path) -> bool:
    """A folder ``save_to_disk`` wrote: one split (``state.json``) or several (``dataset_dict.json``)."""
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def _columns(p: Path) -> list[str]:
    """The columns a parquet file declares (another file without rows declares none)."""
    try:
        import pyarrow.parquet as pq

        return list(pq.read_schema(p).names) if builder(p) == "parquet" and p.is_file() else []
    except Exception:  # noqa: BLE001 - not a parquet file after all
        return []


def _first_line(e: Exception) -> str:
    line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    return line[:240]


@contextlib.contextmanager
def _quiet(datasets, local: bool):
    """No progress bars for local files (a hub download keeps its own)."""
    if not local:
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def open_split(path: str, split: str | None = None, config: str | None = None, cache_dir: str | None = None,
               revision: str | None = None, what: str = "dataset=hf"):
    """One split of a data set as a ``datasets.Dataset``. ``split`` None: the only split there is
    (several: refused, naming them). Whatever ``datasets`` says is wrong is refused in one line."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{what} reads through Hugging Face datasets: pip install datasets") from None
    p = Path(path).expanduser()
    local = is_local(path)
    single = local and (p.is_file() or builder(path) is not None or (p / "state.json").is_file())
    opts = {"cache_dir": str(Path(cache_dir).expanduser()) if cache_dir else None}
    if local and config and (p.is_file() or _saved(p) or builder(path)):
        raise ConfigError(f"{what}: dataset.config names a config of a hub data set (or of a folder whose "
                          f"README lists configs); {path} has none: drop dataset.config")
    try:
        with _quiet(datasets, local):
            if local and p.is_dir() and _saved(p):
                ds = datasets.load_from_disk(str(p))
            elif local and builder(path):
                if not p.exists() and not any(p.parent.glob(p.name)):
                    raise ConfigError(f"{what}: dataset.path '{path}' does not exist")
                ds = datasets.load_dataset(builder(path), data_files=str(p), **opts)["train"]
            elif local and p.is_dir():  # data files named by split, or a hub snapshot with its README's configs
                ds = datasets.load_dataset(str(p), name=config, **opts)
            elif local:
                raise ConfigError(f"{what}: dataset.path '{path}' does not exist")
            else:
                ds = datasets.load_dataset(path, name=config, split=split, revision=revision, **opts)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets' own errors: not found, unknown config or split, no network
        if "corresponds to no data" in str(e):  # datasets' word for data files without a row
            raise ConfigError(f"{what}: {path} holds no rows (columns: {', '.join(_columns(p)) or 'none'})") from None
        hint = "" if local else " (no network? HF_DATASETS_OFFLINE=1 reads what datasets' cache holds)"
        raise ConfigError(f"{what}: cannot open '{path}'{f' config {config}' if config else ''}: "
                          f"{_first_line(e)}{hint}") from None
    if isinstance(ds, dict):  # a DatasetDict
        names = list(ds)
        if split is None and len(names) == 1:
            return ds[names[0]]
        if split not in names:
            ask = f"no split '{split}';{did_you_mean(split, names)}" if split else "several splits:"
            raise ConfigError(f"{what}: {path} has {ask} choose one with dataset.split=<...> (splits: "
                              f"{', '.join(names)})")
        return ds[split]
    if single and split not in (None, "train"):  # datasets calls a lone split train
        raise ConfigError(f"{what}: {path} holds one split: drop dataset.split={split}")
    return ds


def _refuse_column(what: str, col: str, key: str, cols: list[str]) -> ConfigError:
    return ConfigError(f"{what}: no column '{col}' for dataset.{key};{did_you_mean(col, cols)} "
                       f"columns there: {', '.join(cols)}")


def rows(ds, *, prompt=None, turns=None, id_col=None, category=None, what="dataset=hf",
         where: str = "", placeholder: str | None = None) -> list[tuple[str, str, list[str]]]:
    """``(id, category, turns)`` of each row of a ``datasets.Dataset``: the turns from ``turns`` (a list
    of strings per row) or ``prompt`` (one string; neither given: a column named turns, else prompt),
    the id from ``id_col`` (else question_id, else id, else the row's number), the category from
    ``category`` (else a column named category, else "default"). A missing column, an empty split, a
    turn that is not text or a repeated id is refused in one line naming the columns there are."""
    cols = list(ds.column_names)
    if len(ds) == 0:
        raise ConfigError(f"{what}: {where or 'the split'} holds no rows (columns: {', '.join(cols) or 'none'})")
    if prompt and turns:
        raise ConfigError(f"{what}: set dataset.prompt (one turn per row) or dataset.turns (a list of turns), "
                          "not both")
    if not prompt and not turns:
        turns = "turns" if "turns" in cols else None
        prompt = "prompt" if turns is None and "prompt" in cols else None
        if not (prompt or turns):
            raise ConfigError(f"{what} needs dataset.prompt=<column> (one turn per row) or dataset.turns=<column> "
                              f"(a list of turns); columns there: {', '.join(cols)}")
    for col, key in ((prompt, "prompt"), (turns, "turns"), (id_col, "id"), (category, "category")):
        if col and col not in cols:
            raise _refuse_column(what, col, key, cols)
    id_col = id_col or next((c for c in ("question_id", "id") if c in cols), None)
    category = category or ("category" if "category" in cols else None)
    text = prompt or turns
    used = list(dict.fromkeys(c for c in (text, id_col, category) if c))
    out, seen = [], {}
    for n, row in enumerate(ds.select_columns(used).to_list()):
        qid = str(row[id_col]) if id_col and row[id_col] is not None else str(n)
        v = row[text]
        if prompt:
            if not isinstance(v, str):
                raise ConfigError(f"{what}: row {n} (id {qid}): column '{prompt}' holds "
                                  f"{'a null' if v is None else type(v).__name__}, not "
                                  f"text; dataset.prompt names a column of strings (columns: {', '.join(cols)})")
            v = [v]
        elif isinstance(v, str):
            raise ConfigError(f"{what}: row {n} (id {qid}): column '{turns}' holds one string, not a list of "
                              f"turns: use dataset.prompt={turns} (columns: {', '.join(cols)})")
        elif not (isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v)):
            x = next((t for t in v if not isinstance(t, str)), None) if isinstance(v, (list, tuple)) else v
            bad = "an empty list" if v == [] else "a null" if x is None else type(x).__name__
            raise ConfigError(f"{what}: row {n} (id {qid}): column '{turns}' must hold a non-empty list of strings, "
                              f"got {bad} (columns: {', '.join(cols)})")
        if placeholder and any(t.startswith(placeholder) for t in v):
            raise ConfigError(placeholder_error(what, qid, row.get(category) if category else None, where))
        if qid in seen:  # results pair with AR's by (id, turn)
            hint = "name an id column with dataset.id=<column> " if what == "dataset=hf" else ""
            raise ConfigError(f"{what}: id {qid} is on rows {seen[qid]} and {n}; ids must be unique: {hint}"
                              f"(columns: {', '.join(cols)})")
        seen[qid] = n
        cat = str(row[category]) if category and row[category] is not None else "default"
        out.append((qid, cat, list(v)))
    return out


def placeholder_error(what: str, qid: str, category, split: str) -> str:
    return (f"{what}: question {qid}{f' ({category})' if category else ''} still holds the hub's placeholder for "
            "a licensed source: fetch the turns with NVIDIA Model-Optimizer's examples/specdec_bench/prepare_data.py "
            f"--config {split or '<split>'} and set dataset.path to its output folder")


def check_speed_split(split) -> None:
    if not isinstance(split, str) or not re.fullmatch(r"qualitative|throughput_\d+k", split):
        raise ConfigError(f"dataset=speed_bench needs dataset.split=qualitative or throughput_<N>k, got {split!r};"
                          f"{did_you_mean(split, SPEED_SPLITS)} SPEED-Bench's splits: {', '.join(SPEED_SPLITS)}")


def _split_files(folder: Path) -> list[Path]:
    """A split's data files in ``folder`` (and below): its parquet files, else its json / jsonl / csv."""
    files = sorted(f for f in folder.rglob("*") if f.is_file() and builder(f))
    for kind in ("parquet", "json", "csv", "arrow"):
        of_kind = [f for f in files if builder(f) == kind]
        if of_kind:
            return of_kind
    return []


def speed_bench(dcfg) -> list[tuple[str, str, list[str]]]:
    """SPEED-Bench's ``dataset.split`` from ``dataset.path``: one split's file (parquet / jsonl), a
    ``save_to_disk`` folder, or a folder holding the split as ``<split>/`` (the hub's snapshot,
    ``hf download nvidia/SPEED-Bench --repo-type dataset``; a ``save_to_disk`` folder; parquet or
    jsonl files), ``speed/<split>/`` (what ``prepare_data.py --output_dir <path>`` writes) or
    ``<split>.parquet|.jsonl``. A hub id is read as ``datasets`` reads it (config = the split)."""
    split, path, what = dcfg.get("split"), str(dcfg.path), "dataset=speed_bench"
    check_speed_split(split)
    p, cache = Path(path).expanduser(), dcfg.get("cache_dir")
    if not is_local(path):
        ds = open_split(path, "test", split, cache, dcfg.get("revision"), what)
    elif p.is_file() or (p.is_dir() and _saved(p)):
        ds = open_split(path, None if p.is_file() else _saved_split(p, split), None, cache, None, what)
    elif p.is_dir():
        ds = None
        for sub in (p / split, p / "speed" / split, p / "data" / split, *([p] if p.name == split else [])):
            if sub.is_dir():
                ds = open_split(str(sub), _saved_split(sub, split), None, cache, None, what) if _saved(sub) \
                    else _open_files(sub, cache, what, split)
                break
        for name in (f"{split}.parquet", f"{split}.jsonl", f"{split}.json"):
            if ds is None and (p / name).is_file():
                ds = open_split(str(p / name), None, None, cache, None, what)
        if ds is None and (p / "README.md").is_file():  # a hub snapshot laid out otherwise: its card's configs
            ds = open_split(path, "test", split, cache, None, what)
        if ds is None:
            there = sorted(x.name for x in p.iterdir())[:12]
            raise ConfigError(f"{what}: no split {split} in {path} (looked for {split}/, speed/{split}/, "
                              f"{split}.parquet, {split}.jsonl); there: {', '.join(there) or 'nothing'}")
    else:
        raise ConfigError(f"{what}: dataset.path '{path}' does not exist")
    return rows(ds, turns="turns", id_col="question_id", category="category", what=what, where=split,
                placeholder=SPEED_PLACEHOLDER)


def _saved_split(p: Path, split: str) -> str | None:
    """The split to take from a ``save_to_disk`` folder: the one named ``split``, else its ``test``."""
    if not (p / "dataset_dict.json").is_file():
        return None
    names = [x.name for x in p.iterdir() if x.is_dir()]
    return split if split in names else "test" if "test" in names else split


def _open_files(folder: Path, cache_dir, what: str, split: str):
    files = _split_files(folder)
    if not files:
        raise ConfigError(f"{what}: {folder} holds no parquet, json, jsonl or csv file of split {split}")
    import datasets

    try:
        with _quiet(datasets, True):
            return datasets.load_dataset(builder(files[0]), data_files=[str(f) for f in files],
                                         cache_dir=cache_dir)["train"]
    except Exception as e:  # noqa: BLE001 - a file datasets cannot read
        raise ConfigError(f"{what}: cannot read {folder}: {_first_line(e)}") from None


def hf(dcfg) -> list[tuple[str, str, list[str]]]:
    """``dataset=hf``: one split of ``dataset.path`` with the columns ``dataset.prompt`` or ``dataset.turns``,
    ``dataset.id`` and ``dataset.category``."""
    path = str(dcfg.path)
    ds = open_split(path, dcfg.get("split"), dcfg.get("config"), dcfg.get("cache_dir"), dcfg.get("revision"))
    where = f"{path}" + (f" config {dcfg.config}" if dcfg.get("config") else "") + \
        (f" split {dcfg.split}" if dcfg.get("split") else "")
    return rows(ds, prompt=dcfg.get("prompt"), turns=dcfg.get("turns"), id_col=dcfg.get("id"),
                category=dcfg.get("category"), where=where)
