"""Every notebook runs top to bottom (headless) and is committed without outputs; running one
leaves nothing untracked behind, keeps its figures in a static HTML export and prints no
text progress bars."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
SNAPSHOT_CLASS = "moelab-static-view"  # moelab.static_view.SNAPSHOT_CLASS (written out: the test states it)
TEXT_BAR = re.compile(r"\d+%\|.*\|")  # tqdm's text bar: " 40%|####      | 2/5 [...]"
NAN = re.compile(r"(?<![A-Za-z_])NaN(?![A-Za-z_])")  # pandas' missing number in a printed table
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])")  # a printed measurement


def _finite(trace: dict) -> int:
    """Finite numbers a plotly trace (JSON) plots in y, z, values or x."""
    import math

    def flat(v):
        if isinstance(v, dict) and "bdata" in v:  # plotly's typed-array encoding (base64 of a numpy array)
            import base64

            import numpy as np

            return np.frombuffer(base64.b64decode(v["bdata"]), dtype=v.get("dtype", "f8")).astype(float).tolist()
        if isinstance(v, list):
            return [x for item in v for x in flat(item)]
        return [v]

    for key in ("y", "z", "values", "x"):  # the first one given is what the trace plots
        if key in trace:
            vals = [v for v in flat(trace[key]) if v is not None]
            return sum(1 for v in vals if not isinstance(v, (int, float)) or math.isfinite(v))
    return 0


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, f"{path.name} has outputs"


@pytest.mark.slow
@pytest.mark.xdist_group("notebooks")  # one kernel at a time (with `--dist loadgroup`)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    import nbformat
    from jupyter_client import KernelManager
    from nbclient import NotebookClient

    work = tmp_path / "work"  # the notebook's working dir (in Jupyter: notebooks/)
    scratch = tmp_path / "tmp"  # the kernel's temporary directory
    work.mkdir()
    scratch.mkdir()
    monkeypatch.chdir(work)  # notebooks write their traces/artifacts into the working dir
    monkeypatch.setenv("TMPDIR", str(scratch))  # inherited by the kernel
    # one torch thread in the kernel: under `pytest -n 2` the other worker keeps the second core
    # busy, and two spinning OpenMP threads on one free core made notebook 02 take minutes
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(path, as_version=4)
    # IPC sockets named after this test's own connection file: kernels started in parallel
    # cannot collide on TCP ports (a collision loses messages and hangs the client).
    km = KernelManager(kernel_name="python3", transport="ipc", connection_file=str(tmp_path / "kernel.json"))
    client = NotebookClient(nb, km=km, timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(work)}})
    client.execute()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    # figures: plotly's mimetype for JupyterLab *and* HTML, which `nbconvert --to html` keeps
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert all("text/html" in o["data"] for o in figures), "a plotly figure has no HTML output"
    if figures:
        from nbconvert import HTMLExporter

        html, _ = HTMLExporter().from_notebook_node(nb)
        assert html.count("Plotly.newPlot(") >= len(figures), "figures are lost in the HTML export"
    # widgets: each one also carries a static view, which the HTML export of a notebook saved
    # without widget state (JupyterLab's default) shows instead of an empty box
    widget_outputs = [o for o in outputs if WIDGET in o.get("data", {})
                      and not TEXT_BAR.search(str(o["data"].get("text/plain", "")))]  # not progress bars
    assert all("text/html" in o["data"] for o in widget_outputs), \
        f"{path.name}: a widget has no static view (display it through moelab.viz.interactive / StaticView)"
    if widget_outputs:
        from nbconvert import HTMLExporter

        saved = nbformat.from_dict(nb)
        saved.metadata.pop("widgets", None)
        html, _ = HTMLExporter().from_notebook_node(saved)
        assert html.count(f'class="{SNAPSHOT_CLASS}"') == len(widget_outputs), \
            f"{path.name}: the HTML export lost a widget's static view"
    # no empty results passing as a run: every figure plots data, no table shows NaN
    for o in figures:
        fig = o["data"][PLOTLY]
        assert any(_finite(t) for t in fig.get("data", [])), \
            f"{path.name}: figure {fig.get('layout', {}).get('title')!r} plots no data"
    for o in outputs:  # a printed result that is mostly NaN measured nothing
        text = o.get("data", {}).get("text/plain", "")
        text = text if isinstance(text, str) else "".join(text)
        nan, nums = len(NAN.findall(text)), len(NUMBER.findall(text))
        assert not (nan and nan >= 0.5 * (nan + nums)), f"{path.name} shows a result that is mostly NaN:\n{text[:600]}"
    # progress bars are widgets (or nothing), not a text line per update
    streams = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert not TEXT_BAR.search(streams), TEXT_BAR.search(streams).group(0)
    # nothing left behind: temporary directories removed, outputs in git-ignored places
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("moelab")]
    if shutil.which("git") and (ROOT / ".git").exists():
        written = sorted(f"notebooks/{p.name}{'/' if p.is_dir() else ''}" for p in work.iterdir())
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *written],
                                 capture_output=True, text=True).stdout.split() if written else []
        assert sorted(ignored) == written, f"running {path.name} leaves untracked {set(written) - set(ignored)}"
