"""The GPU-readiness audit (``specbench.audit``, ``make audit``): its table and JSON for registered
methods on the tiny random target, what it counts (host reads, ops outside forwards, new bytes) on
steps made to have them, and the fullgraph check."""

import json

import torch

from specbench import audit


def test_the_audit_writes_a_row_per_method_and_batch_size(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert audit.main(["--methods", "ar", "pld", "--bs", "1,2", "--tokens", "6", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["bs"]) for r in rows] == [("ar", 1), ("ar", 2), ("pld", 1), ("pld", 2)]
    for r in rows:
        assert {"method", "bs", "host_reads_per_step", "ops_per_step", "bytes_per_step", "fullgraph"} <= set(r), r
        assert r["host_reads_per_step"] >= 1  # at least the step's tokens come back to the host
        assert r["ops_per_step"] > 0 and r["bytes_per_step"] > 0
        assert r["fullgraph"]["verify"] is True  # the target's verify forward traces whole
    assert "| pld | 2 |" in capsys.readouterr().out


def test_it_counts_each_kind_of_host_read_and_leaves_forwards_out():
    lin = torch.nn.Linear(4, 4)
    with audit._depths(lin, []) as depth:
        c = audit._Count(depth)
        x = torch.randn(3, 4)
        with c, audit._host_methods(c):
            int(x.sum())  # item
            x.tolist()
            x[x > 0]  # a boolean mask: its size depends on the values
            torch.nonzero(x)
            lin(x)  # inside the target's forward: no op counted there
            y = torch.cat([x, x])  # 2x the bytes of x, new
            x.add_(1)  # in place: no new bytes
        assert c.reads == {"item/int/float/bool": 1, "tolist": 1, "aten.index": 1, "aten.nonzero": 1}
        assert c.bytes >= y.untyped_storage().nbytes()
        ops, nbytes = c.ops, c.bytes
        with c:
            lin(x)
        assert (c.ops, c.bytes) == (ops, nbytes)  # the forward's ops and tensors are the model's, not the step's


def test_a_graph_break_is_named():
    ok, why, out = audit._fullgraph(lambda t: t * 2, torch.ones(2))
    assert ok and why is None and out.tolist() == [2.0, 2.0]
    def breaks(t):
        torch._dynamo.graph_break()
        return t * 2

    ok, why, out = audit._fullgraph(breaks, torch.ones(2))
    assert not ok and why and out.tolist() == [2.0, 2.0]  # the break is named, the step still runs eagerly


def test_a_value_written_through_an_index_is_no_read():
    """``anc[:, kids] = True`` writes a boolean value through integer indices: nothing waits."""
    with audit._depths(torch.nn.Linear(1, 1), []) as depth:
        c = audit._Count(depth)
        x = torch.zeros(4, dtype=torch.bool)
        with c, audit._host_methods(c):
            x[torch.tensor([0, 2])] = True
        assert not c.reads
        with c, audit._host_methods(c):
            x[x] = False  # a boolean mask as the index: its size depends on the values
        assert c.reads == {"aten.index_put_": 1}


def test_every_method_reads_the_host_once_a_step():
    """Issue 56: one wait for the device a decoding step (the verdict's read-back, which also
    brings what the records and the method need), for every built-in method at bs 1 and 3 from
    ragged prompts. The commit before this test read 3-17 times a step."""
    rows = audit.audit(None, (1, 3), tokens=10, compile_check=False, progress=False)
    over = [(r["method"], r["bs"], r.get("error") or (r["host_reads_per_step"], r["reads"])) for r in rows
            if "error" in r or r["host_reads_per_step"] > 1]
    assert not over, over


def test_a_drafters_bytes_a_step_do_not_grow_with_its_context():
    """Issue 56 item 3: a drafter's cache grows in place and a forward attends over a view of it
    (with grouped KV heads, none repeated), so the bytes a step makes grow with the context by its
    masks only (a few bytes a context token), not by a copy of the context's keys and values: the
    commit before this test concatenated each layer's whole context (and repeated its heads) every
    drafter forward, at least one copy of the keys and values of one layer a context token."""
    from specbench.tiny import tiny_llama

    cfg = tiny_llama().config
    one_copy = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4  # K+V, a token, fp32
    short, long_, bs = 16, 208, 2
    rows = audit.audit(["dflash", "peagle", "eagle", "mtp", "leviathan"], (bs,), tokens=8, compile_check=False,
                       progress=False, ctxs=(short, long_))
    assert not [r for r in rows if "error" in r], rows
    by = {(r["method"], r["ctx"]): r["bytes_per_step"] for r in rows}
    growth = {m: (by[m, long_] - by[m, short]) / ((long_ - short) * bs) for m, _ in by}
    assert all(g < one_copy for g in growth.values()), (growth, one_copy)
