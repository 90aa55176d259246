"""Device discipline, held on the CPU: with torch's default device set to ``meta`` after loading, any
tensor the engine or a method makes without an explicit device lands on ``meta`` and fails (the bug
class a first GPU run meets: index tensors and masks built on the CPU); and the decode step reads the
device (``.item()``, ``.tolist()``, ``.cpu()``, a tensor's truth value) a bounded number of times per
step, not once per node or per row."""

import pytest
import torch

import test_serving
from helpers import CPU, prompts_of, reference_greedy, serve_engine, tiny_llama

datastore = test_serving.datastore
cases = test_serving.cases
N_NEW = 12
LENGTHS = [7, 3, 12, 5, 9]
NAMES = ["ar", "pld", "leviathan_self", "leviathan_other", "eagle", "eagle_small_vocab", "medusa", "medusa_chain",
         "lookahead", "specdec", "sam", "sam_recycle", "suffix", "recycle", "combo", "rest", "dflash", "dspark", "peagle", "mtp"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, scale=4.0, device=CPU)


@pytest.fixture(scope="module")
def cpu_refs(model):
    prompts = prompts_of(LENGTHS, seed=11)
    return prompts, [reference_greedy(model, p, N_NEW) for p in prompts]


@pytest.mark.skipif(test_serving.DEVICE.type != "cpu", reason="runs on the CPU: meta is the stand-in for another device")
@pytest.mark.parametrize("name", NAMES)
def test_every_method_makes_its_tensors_on_the_engines_device(model, cpu_refs, datastore, name):
    prompts, want = cpu_refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}
    prop = test_serving.make(name, model, truth, datastore)  # loading happens before: weights are real
    eos = want[2][4]  # a token some rows emit early: rows leave mid-batch, and others join
    torch.set_default_device("meta")
    try:
        res, _ = serve_engine(model, prop, prompts, N_NEW, concurrency=3, eos={eos})
    finally:
        torch.set_default_device(None)
    for r, ref in zip(res, want):
        assert r.tokens == test_serving.cut(ref, eos)


class Reads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values back to the host (a device sync on a GPU)."""
    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(model, prop, prompts, n_new):
    """Host reads per decoding step of a static batch (prefill and the first pick excluded)."""
    from helpers import run_engine
    from specbench.decode.engine import Engine

    steps = {}
    orig = Engine._step

    def step(self, *a, **k):
        with Reads() as r:
            out = orig(self, *a, **k)
        steps.setdefault("reads", []).append(r.n)
        return out

    Engine._step = step
    try:
        run_engine(model, prop, prompts, n_new)
    finally:
        Engine._step = orig
    return steps["reads"]


@pytest.mark.parametrize("name", NAMES)
def test_a_decode_step_reads_the_device_a_bounded_number_of_times(model, cpu_refs, datastore, name):
    """The host reads a step makes do not grow with the rows: at 9 ragged rows as many as at 3 (give
    or take two), and never more than a small fixed number (tree walks read their tree once, not per
    node; a chain drafter's cache may read once per draft token)."""
    prompts, want = cpu_refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}
    per = {}
    for rows in (3, 9):
        ps = (prompts * 2)[:rows]  # ragged
        counts = reads_per_step(model, test_serving.make(name, model, truth, datastore), ps, 8)
        per[rows] = max(counts[:-1] or counts)  # the last step may be cut by the budget
    assert per[9] <= per[3] + 2, per
    assert per[9] <= 32, per


def test_a_method_that_reads_once_per_row_is_caught(model, cpu_refs, datastore):
    """The count above can fail: a proposer that reads a value back for each row."""
    prompts, want = cpu_refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}
    per = {}
    for rows in (3, 9):
        prop = test_serving.make("pld", model, truth, datastore)
        plain = prop.propose

        def propose(state, plain=plain):
            lens = torch.tensor([len(s) for s in state.seqs])
            _ = [int(lens[b]) for b in range(len(state.seqs))]  # the bug: one read per row
            return plain(state)

        prop.propose = propose
        counts = reads_per_step(model, prop, (prompts * 2)[:rows], 8)
        per[rows] = max(counts[:-1] or counts)
    assert per[9] > per[3] + 2
