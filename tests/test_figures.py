"""What a reader of the report sees: every figure whole (no text cut at the image's edge), sharp
(200 dpi), with embedded TrueType fonts in its PDF, and saying what it leaves out. Run on the
gallery's sets of committed baselines (analysis.gallery: every figure the report draws from
them), the first of them 12 methods, AR included, and on a set made from the test fixture for
the figures no baseline draws (a sweep over ctx, a model that thinks)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.text import Text
from PIL import Image

from specbench.analysis import bound_figure, figures, gallery, report
from specbench.run import records as R

FIX = Path(__file__).parent / "fixtures" / "records.jsonl"


def ctx_and_thinking_set(out: Path) -> tuple[list[Path], str]:
    """The fixture's bs-1 jobs at three input lengths (``ctx``; tau falling with it), each request
    thinking over its first half of steps (``thinking_steps``, as a model with ``<think>`` records):
    the report of it, as ``gallery.build_set`` gives one."""
    recs = [r for r in R.read(FIX) if r["status"] == "ok" and r["bs"] == 1]
    path = out.parent / f"{out.name}-records" / "records.jsonl"
    for i, ctx in enumerate((256, 1024, 4096)):
        for r in recs:
            r = json.loads(json.dumps(r))
            r["ctx"] = ctx
            if r["method"] != "ar":
                r["metrics"]["tau"] = 1 + (r["metrics"]["tau"] - 1) * (1 - 0.2 * i)
                r["metrics"]["speedup"] *= 1 - 0.1 * i
            for q in r["requests"]:
                q["thinking_steps"] = [[0, q["steps"] // 2]]
            R.append(path, r)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        written = report.build(path.parent, out)
    return written, err.getvalue()


SETS = [*gallery.SETS, "ctx-thinking"]

def _build(name, tmp):
    """The report of one gallery set: its files, every PNG's drawn texts (text, extent in the
    saved image's pixels, the canvas drawn on), the figures by name, and what it printed."""
    drawn, figs, current = {}, {}, []
    text_draw, savefig = Text.draw, Figure.savefig

    def draw(self, renderer):
        text_draw(self, renderer)
        if current and self.get_visible() and self.get_text().strip() and hasattr(renderer, "buffer_rgba"):
            drawn[current[0]].append((self.get_text(), self.get_window_extent(renderer),
                                      (renderer.width, renderer.height)))

    def spy(self, fname, *a, **kw):
        current[:] = [Path(fname).name]
        drawn[Path(fname).name] = []
        figs[Path(fname).stem] = self
        try:
            return savefig(self, fname, *a, **kw)
        finally:
            current.clear()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Text, "draw", draw)
        mp.setattr(Figure, "savefig", spy)
        written, err = gallery.build_set(name, tmp) if name in gallery.SETS else ctx_and_thinking_set(tmp)
    return written, drawn, figs, err


_BUILT: dict = {}


def _built(name, tmp_path_factory):
    if name not in _BUILT:
        _BUILT[name] = _build(name, tmp_path_factory.mktemp(name))
    return _BUILT[name]


@pytest.fixture(scope="module", params=SETS)
def any_set(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The twelve methods' report (AR included)."""
    return _built("methods", tmp_path_factory)


def test_every_figure_keeps_every_text_inside_the_saved_image(any_set):
    written, drawn, _, _ = any_set
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) >= 5, pngs
    for p in pngs:
        img = Image.open(p)
        W, H = img.size
        assert img.info["dpi"][0] == pytest.approx(200, abs=1), (p.name, img.info.get("dpi"))
        texts = [(t, e) for t, e, canvas in drawn[p.name] if canvas == (W, H)]  # the pass that made the file
        assert texts, f"{p.name}: no text drawn at the saved size {W}x{H}"
        cut = [t for t, e in texts if e.x0 < -1 or e.y0 < -1 or e.x1 > W + 1 or e.y1 > H + 1]
        assert not cut, f"{p.name} ({W}x{H}) cuts: {cut[:6]}"


def test_every_pdf_embeds_truetype_fonts(any_set):
    written = any_set[0]
    for p in (p for p in written if p.suffix == ".pdf"):
        pdf = p.read_bytes()
        assert b"/Type3" not in pdf, f"{p.name}: type 3 fonts (set pdf.fonttype 42)"
        assert b"/FontFile2" in pdf, f"{p.name}: no embedded TrueType font"


def test_the_bound_figure_says_what_it_leaves_out(built):
    _, _, figs, err = built
    fig = figs["speedup_vs_bound"]
    texts = [t.get_text() for t in fig.findobj(Text)]
    # measured bars carry their 95% bootstrap interval; the 1.0 line is named in the legend
    assert all(any(isinstance(c, ErrorbarContainer) for c in ax.containers) for ax in fig.axes)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert figures.AR_LINE in legend and "measured (95% CI)" in legend
    # REST drafts no fixed K: its empty bound bars say so
    assert any("no bound" in t and "no fixed K" in t for t in texts)
    # no cost curve beside these records: the caption says the batch-aware bound is missing, and the
    # report prints the command that profiles one, once
    assert any(t.startswith("batch-aware bound not drawn") for t in texts)
    lines = [ln for ln in err.splitlines() if "batch-aware bound not drawn" in ln]
    assert len(lines) == 1 and "python -m specbench.analysis.profile --model smollm2-135m" in lines[0]


def test_panels_split_evenly(built):
    assert [s.stop - s.start for s in bound_figure.panels_of(11)] == [6, 5]
    assert [s.stop - s.start for s in bound_figure.panels_of(10)] == [10]
    assert [s.stop - s.start for s in bound_figure.panels_of(21)] == [7, 7, 7]
    fig = built[2]["speedup_vs_bound"]
    sizes = [len(ax.get_xticks()) for ax in fig.axes]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert len({ax.get_xlim() for ax in fig.axes}) == 1  # every panel as wide: bars of one width



def test_no_two_texts_of_a_figure_overlap(any_set):
    written, drawn, _, _ = any_set
    bad = {}
    for p in (p for p in written if p.suffix == ".png"):
        W, H = Image.open(p).size
        texts = [(t, e) for t, e, canvas in drawn[p.name] if canvas == (W, H)]
        hits = [(a, b) for i, (a, ea) in enumerate(texts) for b, eb in texts[i + 1:]
                if min(ea.x1, eb.x1) - max(ea.x0, eb.x0) > 2 and min(ea.y1, eb.y1) - max(ea.y0, eb.y0) > 2]
        if hits:
            bad[p.name] = hits[:3]
    assert not bad, bad


def test_a_speedup_on_an_ar_run_apart_is_marked_unpaired_in_the_figures(tmp_path, monkeypatch):
    """The fixture's records were run with ar_baseline=sweep: every series says so."""
    from specbench.analysis import report

    figs = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name, written: figs.setdefault(name, fig))
    report.build(Path(__file__).parent / "fixtures" / "records.jsonl", tmp_path / "rep")
    ticks = [t.get_text() for ax in figs["speedup_vs_bound"].axes for t in ax.get_xticklabels()]
    assert ticks and all("(unpaired)" in t for t in ticks), ticks


def test_series_that_priced_or_drafted_differently_are_told_apart():
    """A synthetic tree priced by the first-child rule (records before sibling_rates) or by other
    sibling rates, and DSpark's argmax drafts at a temperature, are series of their own."""
    from specbench.analysis.load import label
    from specbench.decode.verify import SIBLING_RATES

    syn = {"method": "eagle", "accept": "synthetic", "accept_rates": [0.743], "method_cfg": {}}
    assert label({**syn, "accept_sibling_rates": list(SIBLING_RATES)}) == "eagle (synthetic 0.743)"
    assert label({**syn, "accept_sibling_rates": None}) == "eagle (synthetic 0.743, first-child rule)"
    assert label({**syn, "accept_sibling_rates": [0.3, 0.1]}) == "eagle (synthetic 0.743, siblings 0.3/0.1)"
    ds = {"method": "dspark", "temperature": 1.0}
    assert label({**ds, "method_cfg": {"sample_drafts": True}}) == "dspark"
    assert label({**ds, "method_cfg": {}}) == "dspark (argmax drafts)"
    assert label({**ds, "temperature": 0.0, "method_cfg": {}}) == "dspark"


def test_the_ctx_sweep_draws_speedup_and_tau_and_the_thinking_split_its_parts(tmp_path_factory):
    written, _, figs, _ = _built("ctx-thinking", tmp_path_factory)
    names = {p.name for p in written}
    assert {"speedup_vs_ctx.png", "tau_vs_ctx.png", "acceptance_by_thinking.png", "acceptance_by_turn.png"} <= names
    ax = figs["tau_vs_ctx"].axes[0]
    assert ax.get_ylabel().startswith("mean accepted length tau")
    pld4 = next(ln for ln in ax.get_lines() if ln.get_label() == "pld (unpaired), K=4")
    assert list(pld4.get_xdata()) == [256, 1024, 4096] and list(pld4.get_ydata()) == sorted(pld4.get_ydata())[::-1]
    legend = [t.get_text() for t in figs["acceptance_by_thinking"].axes[1].get_legend().get_texts()]
    assert legend == ["inside thinking", "outside thinking"]
    md = next(p for p in written if p.name == "acceptance_by.md").read_text()
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in md.splitlines() if ln.startswith("| pld")]
    inside = [float(r[2]) for r in rows if r[1] == "inside thinking"]  # steps %: each request's first half
    assert len(inside) == 6 and all(40 < x <= 50 for x in inside), rows
    assert {r[1] for r in rows} == {"turn 1", "turn 2", "inside thinking", "outside thinking"}
