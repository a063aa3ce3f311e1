"""Regeneration golden test: generated/ is exactly what derive/ + codegen/ produce.

``pytest --update-generated`` rewrites generated/ instead of failing.  The test output reports
the generation time and the generated-code size per model."""
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from codegen.cli import GENERATED, stale
from codegen.generate import render_all, write
from codegen.printer import doprint
from derive.registry import pregenerated

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rendered():
    return render_all()


def test_generated_matches_registry(rendered, request):
    if request.config.getoption("--update-generated"):
        write(rendered, GENERATED)
    diffs = stale(rendered, GENERATED)
    assert not diffs, ("generated/ is stale (run `regenerate-kernels` or pytest --update-generated):\n"
                       + "".join(diffs)[:5000])


def test_generation_is_deterministic_and_fast(rendered, capsys):
    """Each kernel again from a freshly derived program: the same text as in its module (so the
    output does not depend on SymPy caches or dict order); report time and size per model."""
    per_model = defaultdict(lambda: [0.0, 0])
    for kernel in pregenerated():
        start = time.perf_counter()
        text = doprint(kernel.build(), kernel.name)
        model = kernel.name.rsplit("_", 1)[0]
        per_model[model][0] += time.perf_counter() - start
        per_model[model][1] += len(text)
        assert text in rendered[f"{kernel.module}.pyx"].replace("\n    ", "\n")
    with capsys.disabled():
        print("\nmodel                                    generate [s]  C code [kB]")
        for model, (seconds, size) in sorted(per_model.items()):
            print(f"{model:40s} {seconds:12.2f} {size / 1e3:12.1f}")
    assert max(s for s, _ in per_model.values()) < 30, "a model that takes this long to generate is a bug"


def test_every_file_says_do_not_edit(rendered):
    for name, text in rendered.items():
        if name.endswith((".pyx", ".py")):
            assert text.startswith(("# DO NOT EDIT", '"""DO NOT EDIT'))


def test_check_detects_stale_folder(tmp_path, rendered, capsys):
    write(rendered, tmp_path)
    assert stale(rendered, tmp_path) == []
    (tmp_path / "attention_L1.pyx").write_text("stale\n")
    (tmp_path / "extra.pyx").write_text("left over\n")
    diffs = stale(rendered, tmp_path)
    assert len(diffs) == 2 and any("-stale" in d for d in diffs)


def test_regenerate_kernels_check_command():
    """The installed command itself, as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "codegen.cli", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "up to date" in done.stderr


def test_on_demand_compile_is_shared_between_processes(tmp_path):
    """Two processes that need the same on-demand module at once (pytest -n, MPI ranks): one
    compiles it, the other waits for it under the cache folder's lock and imports the same build."""
    script = ("import numpy as np\n"
              "from smi_core import LinkModel, index_symbols, register_link\n"
              "register_link('lock_cube', index_symbols(1, 1)[0, 0] ** 3)\n"
              "print(LinkModel('lock_cube').forward(np.full((1, 1, 1), 2.0)).ravel()[0])\n")
    env = {**os.environ, "SMI_CACHE": str(tmp_path)}
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err for _, err in outs]
    assert [float(out) for out, _ in outs] == [8.0, 8.0]
    assert sum("smi: compiling kernels" in err for _, err in outs) == 1
    assert len(list(tmp_path.glob("kernels/*/*.so"))) == 1
