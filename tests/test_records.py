"""The records file: lines that cannot be read are reported (never silently lost), the index
beside it that pairing and resume read instead of every output token, and the cost curves'
reader in analysis; the divergence bookkeeping and the code state a record carries."""

import json
import subprocess
import sys

import pytest

from specbench.analysis import load as L
from specbench.run import records as R

from conftest import REPO


def _rec(method, job_id, **kw):
    return {"method": method, "job_id": job_id, "status": "ok", "metrics": {"tokens_per_s": 1.0},
            "requests": [{"id": 1, "tokens": list(range(50))}], **kw}


def test_read_reports_every_line_it_skips(tmp_path, capsys):
    p = tmp_path / "records.jsonl"
    R.append(p, _rec("ar", "a"))
    with p.open("a") as f:
        f.write("null\n[1, 2]\n")  # a hand edit: JSON, but not a record
    R.append(p, _rec("pld", "b"))
    with p.open("a") as f:
        f.write('{"method": "lev')  # cut by a crash
    assert [r["method"] for r in R.read(p)] == ["ar", "pld"]
    err = capsys.readouterr().err
    assert f"{p}: 3 records line(s) could not be read and were skipped (line 2, line 3, line 5: null, not a record)" in err
    R.read(p, report=False)
    assert capsys.readouterr().err == ""


def test_cost_curves_survive_a_null_and_a_torn_line(tmp_path, capsys):
    f = tmp_path / "cost_curves.jsonl"
    good = {"device": "cpu", "bs": 1, "n": 1, "ms": 40.0}
    f.write_text(json.dumps(good) + "\nnull\n" + json.dumps(good) + '\n{"device": "cp')
    assert L.load_cost_curves(tmp_path) == [good, good]
    err = capsys.readouterr().err
    assert "2 cost-curve line(s) could not be read" in err and str(f) in err


def test_index_holds_keys_only_and_load_returns_the_whole_record(tmp_path):
    p = tmp_path / "records.jsonl"
    for i, m in enumerate(("ar", "pld", "leviathan")):
        R.append(p, _rec(m, f"j{i}", bs=1))
    idx = R.index(p)
    assert [e["method"] for e in idx] == ["ar", "pld", "leviathan"]
    assert all("metrics" not in e and "requests" not in e for e in idx)  # what pairing reads: no tokens
    assert [R.load(p, e) for e in idx] == R.read(p)
    assert len(R._index_path(p).read_text().splitlines()) == 3  # append keeps the index as it writes


def test_index_is_mended_after_a_crash_a_hand_edit_and_a_replaced_file(tmp_path, capsys):
    p = tmp_path / "records.jsonl"
    R.append(p, _rec("ar", "a"))
    R.append(p, _rec("pld", "b"))
    # a crash between the record and its index line: the reader indexes what the index lacks
    with p.open("a") as f:
        f.write(json.dumps(_rec("rest", "c")) + "\n")
    assert [e["job_id"] for e in R.index(p)] == ["a", "b", "c"]
    assert len(R._index_path(p).read_text().splitlines()) == 3  # kept: parsed once
    # a torn line is reported (every read), and the next record after it is indexed and loads whole
    with p.open("a") as f:
        f.write('{"method": "lev')
    R.append(p, _rec("eagle", "d"))
    idx = R.index(p)
    assert [e["job_id"] for e in idx] == ["a", "b", "c", "d"]
    assert R.load(p, idx[-1])["requests"][0]["tokens"] == list(range(50))
    assert "1 records line(s) could not be read" in capsys.readouterr().err
    # the file replaced by another one (a copy from another run): the stale index is rebuilt
    p.write_text(json.dumps(_rec("medusa", "x")) + "\n")
    assert [e["job_id"] for e in R.index(p)] == ["x"]
    # an index in an older or broken format is rebuilt too
    R._index_path(p).write_text('{"nonsense": 1}\n')
    assert [e["job_id"] for e in R.index(p)] == ["x"]


def test_load_refuses_an_entry_whose_record_moved(tmp_path):
    p = tmp_path / "records.jsonl"
    R.append(p, _rec("ar", "a"))
    R.append(p, _rec("pld", "b"))
    entry = R.index(p)[1]
    p.write_text(json.dumps(_rec("pld", "zzzz-other-record")) + "\n" * 400)
    with pytest.raises(RuntimeError, match="changed while it was read"):
        R.load(p, entry)


def test_pairing_reads_the_index_not_the_output_tokens(tmp_path, monkeypatch):
    """find_ar over the index picks the same AR record as over whole records, and a job's
    decisions do not parse the heavy part of earlier records (the quadratic cost of a sweep)."""
    p = tmp_path / "records.jsonl"
    base = {k: None for k in R.BASELINE_KEYS}
    R.append(p, _rec("ar", "old", sweep_id="s1", **{**base, "bs": 1}))
    R.append(p, _rec("ar", "new", sweep_id="s2", **{**base, "bs": 1}))
    R.append(p, _rec("ar", "bs2", sweep_id="s2", **{**base, "bs": 2}))
    R.index(p)  # the index is complete now
    parsed = []
    real = json.loads
    monkeypatch.setattr(R.json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real(s, *a, **k))
    probe = {**base, "bs": 1, "method": "pld"}
    entry = R.find_ar(R.index(p), probe, "s2")
    assert entry["job_id"] == "new"
    full = max(len(x) for x in p.read_bytes().splitlines())
    index_line = max(len(x) for x in R._index_path(p).read_bytes().splitlines())
    assert index_line < full and max(parsed) <= index_line  # no whole record parsed to decide
    assert R.load(p, entry)["requests"][0]["tokens"] == list(range(50))


def test_records_of_the_kernel_under_its_old_name_pair_and_resume():
    """``kernel=avx2`` records (the native path's old name) pair with a ``native`` job as its AR
    and count as the same job on resume; another kernel does not."""
    base = {k: None for k in R.BASELINE_KEYS}
    old_ar = {**base, "method": "ar", "status": "ok", "kernel": "avx2", "job_id": "a"}
    old_pld = {**base, "method": "pld", "status": "ok", "kernel": "avx2", "job_id": "p"}
    probe = {**base, "method": "pld", "kernel": "native"}
    assert R.find_ar([old_ar], probe, None)["job_id"] == "a"
    assert R.find_done([old_pld], probe)["job_id"] == "p"
    assert R.find_ar([old_ar], {**probe, "kernel": "onednn"}, None) is None


SWEEP = ["model=hf", "dataset=jsonl", "method=pld", "K=1,2", "limit=2", "max_new_tokens=8", "progress=false",
         "resume=true", "warmup=false"]


def test_two_resumed_sweeps_at_once_run_each_job_once(tiny_dirs, tmp_path):
    """Two `resume=true` sweeps started together on one records file: each job (and AR) is
    decided under its lock, so every job has exactly one record."""
    args = [sys.executable, "-m", "specbench", "ar_baseline=sweep", f"model.path={tiny_dirs['target']}",
            f"dataset.path={tiny_dirs['questions']}", f"results_dir={tmp_path}", *SWEEP]
    procs = [subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errs
    recs = R.read(tmp_path / "records.jsonl")
    assert sorted((r["method"], r["K"]) for r in recs if r["method"] == "pld") == [("pld", 1), ("pld", 2)]
    assert [r["method"] for r in recs].count("ar") == 1
    assert sum(e.count("already recorded") for e in errs) == 2  # the later sweep skipped both jobs


def test_a_torn_index_line_hides_no_record(tmp_path):
    """A crash that cuts the index's last line: the next entries are not appended onto it (and
    lost), and the cut entry's record is indexed again."""
    p = tmp_path / "records.jsonl"
    for i in range(3):
        R.append(p, _rec("pld", f"j{i}"))
    ip = p.with_name(p.name + ".idx")
    raw = ip.read_bytes()
    ip.write_bytes(raw[:-20])  # the last entry cut mid-line, no newline
    R.append(p, _rec("pld", "j3"))
    R.append(p, _rec("pld", "j4"))
    assert [e["job_id"] for e in R.index(p)] == [r["job_id"] for r in R.read(p)] == [f"j{i}" for i in range(5)]
    assert [e["job_id"] for e in R.index(p)] == [f"j{i}" for i in range(5)]  # and stays mended


def test_a_gzipped_records_file_reads_as_the_plain_one(tmp_path):
    """Kept baselines are stored gzipped (results/baselines/*.jsonl.gz): a file or a folder of them reads alike."""
    import gzip
    import json

    from specbench.run import records as R

    recs = [{"schema": R.SCHEMA, "method": "ar", "status": "ok", "n": i} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "records.jsonl").write_text(text)
    (tmp_path / "b").mkdir()
    with gzip.open(tmp_path / "b" / "records.jsonl.gz", "wt") as f:
        f.write(text)
    assert R.read(tmp_path / "b" / "records.jsonl.gz") == R.read(tmp_path / "a" / "records.jsonl") == recs
    assert R.read(tmp_path / "b") == recs


def test_first_divergence_bookkeeping():
    assert R.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert R.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert R.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early (an EOS)
    ar = [{"id": "a", "turn": 1, "prompt_sha": "p", "tokens": [1, 2, 3, 4]},
          {"id": "a", "turn": 2, "prompt_sha": "q", "tokens": [7, 7]},
          {"id": "b", "turn": 1, "prompt_sha": "r", "tokens": [5, 6]}]
    ref = {(r["id"], r["turn"], 0): r for r in ar}
    mine = [{"id": "a", "turn": 1, "prompt_sha": "p", "tokens": [1, 2, 9, 4]},
            {"id": "a", "turn": 2, "prompt_sha": "other", "tokens": [7, 8]},  # its prompt already differs
            {"id": "b", "turn": 1, "prompt_sha": "r", "tokens": [5, 6]}]
    d = R.divergence(mine, ref)
    assert d == {"compared": 2, "diverged": 1, "median_at": 2, "first_at": 2, "positions": [2]}
    assert mine[0]["diverge_at"] == 2 and "diverge_at" not in mine[1] and mine[2]["diverge_at"] is None


def test_records_reader_skips_a_cut_line(tmp_path):
    p = tmp_path / "records.jsonl"
    R.append(p, {"method": "ar", "status": "ok"})
    with p.open("a") as f:
        f.write('{"method": "pld", "sta')
    assert [r["method"] for r in R.read(p)] == ["ar"]
    assert json.loads(p.read_text().splitlines()[0])["status"] == "ok"
    R.append(p, {"method": "leviathan", "status": "ok"})  # the next record after the cut survives
    assert [r["method"] for r in R.read(p)] == ["ar", "leviathan"]


def test_code_state_tells_uncommitted_states_apart(tmp_path):
    """``<sha>-dirty`` for any change let resume and ar_baseline=any pair records of different
    code: the label carries a hash of the diff and of untracked source files."""
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("results/\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "c")
    clean = R.code_state(tmp_path)
    assert clean and "dirty" not in clean
    (tmp_path / "m.py").write_text("x = 2\n")
    a = R.code_state(tmp_path)
    (tmp_path / "m.py").write_text("x = 3\n")
    b = R.code_state(tmp_path)
    assert a.startswith(clean + "-dirty-") and b.startswith(clean + "-dirty-") and a != b
    assert R.code_state(tmp_path) == b  # the same state, the same label
    (tmp_path / "new_method.py").write_text("y = 1\n")  # an untracked source file is code
    c = R.code_state(tmp_path)
    assert c != b
    (tmp_path / "new_method.py").write_text("y = 2\n")
    assert R.code_state(tmp_path) != c
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "records.jsonl").write_text("{}\n")  # ignored: not code
    (tmp_path / "notes.bin").write_bytes(b"\0")  # not a source file
    assert R.code_state(tmp_path) == R.code_state(tmp_path)
    d = R.code_state(tmp_path)
    (tmp_path / "results" / "records.jsonl").write_text("{}\n{}\n")
    assert R.code_state(tmp_path) == d
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "new_method.py").unlink()
    assert R.code_state(tmp_path) == clean
    assert R.code_state(tmp_path / "results") is not None  # a subfolder of the work tree: the same repo
