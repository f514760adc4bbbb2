"""Every notebook runs top to bottom (headless) and is committed without outputs."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


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

    monkeypatch.chdir(tmp_path)  # notebooks write their traces/artifacts into the working dir
    nb = nbformat.read(path, as_version=4)
    # IPC sockets named after this test's own connection file: kernels started in parallel
    # cannot collide on TCP ports (a collision loses messages and hangs the client).
    km = KernelManager(kernel_name="python3", transport="ipc", connection_file=str(tmp_path / "kernel.json"))
    client = NotebookClient(nb, km=km, timeout=600, startup_timeout=120,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
