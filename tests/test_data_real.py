"""The packaged prompt sets and the real default model (slow: loads SmolLM2-135M)."""

import json
import subprocess
import sys

import pytest

from specbench.run import data as D
from specbench.run import records as R

from conftest import REPO


def test_packaged_prompt_sets():
    mt = D.mt_bench()
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    assert {q.category for q in mt} >= {"writing", "coding", "math"}
    he = D.humaneval()
    assert len(he) == 164 and all("def " in q.turns[0] for q in he)
    gsm = D.gsm8k()
    assert len(gsm) == 100 and "boxed" in gsm[0].turns[0]


@pytest.mark.slow
def test_sharegpt_slices_are_disjoint():
    """The `sharegpt` prompt set and the `ctx` filler come from the evaluation slice; drafter
    training reads only the conversations after it."""
    sg = D.sharegpt()
    assert 1900 < len(sg) <= D.SHAREGPT_EVAL
    longs = D.long_texts()
    assert len(longs) == 256 and len(longs[0]) > 20000
    train = D.sharegpt_training()
    assert len(train) > 9000  # 9,925 usable conversations after the evaluation slice
    assert all(c["turns"][0][0] == "user" for c in train)
    eval_ids = {q.id.removeprefix("sharegpt-") for q in sg}
    assert not eval_ids & {c["id"] for c in train}
    filler_ids = {r["id"] for r in D._sharegpt_cache()["long"]}
    assert len(filler_ids) > 200 and not filler_ids & {c["id"] for c in train}


@pytest.mark.slow
def test_smollm2_sweep(tmp_path):
    """A short real sweep: AR, PLD, Leviathan (the shipped draft, the default), Medusa and EAGLE
    (the shipped heads) on two MT-Bench turns of SmolLM2, token-identical."""
    out = subprocess.run(
        [sys.executable, "-m", "specbench", "ar_baseline=sweep", "method=pld,leviathan,medusa,eagle", "limit=1", "max_new_tokens=24",
         f"results_dir={tmp_path}", "progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert [r["method"] for r in recs] == ["ar", "pld", "leviathan", "medusa", "eagle"]
    for r in recs:
        assert r["status"] == "ok" and r["model"] == "smollm2-135m" and r["dtype"] == "float32"
        assert r["metrics"]["match_ar"] == 1.0
        assert [q["turn"] for q in r["requests"]] == [1, 2]
        assert r["metrics"]["new_tokens"] > 0 and r["metrics"]["tokens_per_s"] > 0
    assert recs[2]["draft"] == "smollm2-135m-draft"
    assert recs[4]["method_cfg"]["draft_vocab"] == 16384 and recs[3]["method_cfg"]["nodes"] > 4
    assert all(r["metrics"]["tau"] > 1.2 for r in recs[3:])  # the trained heads are really accepted from
    assert "speedup" in out.stdout


@pytest.mark.slow
def test_gemma3_sweep(tmp_path):
    """Gemma-3-270M (sliding-window layers, 262k vocabulary) end to end: ragged rows at bs=2,
    PLD token-identical to AR."""
    out = subprocess.run(
        [sys.executable, "-m", "specbench", "ar_baseline=sweep", "model=gemma3-270m", "method=pld", "bs=2", "limit=2",
         "dataset.max_turns=1", "max_new_tokens=8", f"results_dir={tmp_path}", "progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert [(r["method"], r["status"], r["model"]) for r in recs] == [("ar", "ok", "gemma3-270m"),
                                                                     ("pld", "ok", "gemma3-270m")]
    assert recs[1]["metrics"]["match_ar"] == 1.0 and recs[1]["metrics"]["new_tokens"] > 0


@pytest.mark.slow
def test_lookahead_rest_specdec_sweep_with_task_scores(tmp_path):
    """Lookahead and SpecDec (the shipped Spec-Drafter) on a GSM8K problem, REST on a
    HumanEval problem with a small code datastore: token-identical to AR, and every job
    (AR included) carries the set's task score."""
    store = tmp_path / "code.jsonl"
    store.write_text("\n".join(json.dumps({"text": t}) for t in [
        "def add(a, b):\n    return a + b\n", "for i in range(len(numbers)):\n    for j in range(len(numbers)):\n",
        "    return [x for x in numbers if x > 0]\n"]) + "\n")
    runs = [["method=lookahead,specdec", "dataset=gsm8k"],
            ["method=rest", f"rest.datastore={store}", "dataset=humaneval"]]
    for args in runs:
        out = subprocess.run([sys.executable, "-m", "specbench", "ar_baseline=sweep", *args, "limit=1", "max_new_tokens=32",
                              f"results_dir={tmp_path}", "progress=false"],
                             cwd=REPO, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert [r["method"] for r in recs] == ["ar", "lookahead", "specdec", "ar", "rest"]
    for r in recs:
        assert r["status"] == "ok" and r["metrics"]["match_ar"] == 1.0, r["method"]
        q = r["metrics"]["quality"]
        assert q["metric"] == ("gsm8k_accuracy" if r["dataset"] == "gsm8k" else "humaneval_pass@1")
        assert q["value"] in (0.0, 1.0) and q["n"] == 1
        if r["method"] != "ar":
            assert q["ar_value"] is not None
    assert recs[1]["metrics"]["forward_nodes"] > recs[1]["metrics"]["draft_nodes"]  # the window is verified too
    assert recs[2]["lossless"] and recs[2]["method_cfg"]["beta"] == 1


@pytest.mark.slow
def test_peers_benchmark_runs_and_agrees(tmp_path):
    """`make bench-peers` in miniature: both sides run the same packed (oneDNN) model, AR is
    token-identical to `generate`, each side's PLD and Leviathan equal its own AR (fp32), and the
    JSON line carries every ratio."""
    out = subprocess.run(
        [sys.executable, "-m", "specbench.peers", "--limit", "1", "--max-new", "8", "--bs", "1,2", "--dtype", "fp32",
         "--kernel", "onednn", "--out", str(tmp_path / "peers.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads((tmp_path / "peers.jsonl").read_text().splitlines()[-1])
    assert line["kernel"] == "onednn" and line["dtype"] == "float32"
    for k in ("ar_bs1", "ar_bs2", "pld", "leviathan"):
        assert line[f"{k}_ratio"] > 0, k
    assert line["ar_bs1_identical"] == 1.0 and line["ar_bs2_identical"] == 1.0
    assert line["as_own_ar"] == {"pld": [1.0, 1.0], "leviathan": [1.0, 1.0]}
