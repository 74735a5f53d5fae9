"""Layout promises of DESIGN.md §2: stages/ and kernels/ install under growtrain, and nothing
named `kernels` at the top level can shadow the PyPI package bitsandbytes imports."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, cli_env


def test_stages_and_kernels_install_as_growtrain_subpackages():
    import growtrain.kernels
    import growtrain.stages

    assert growtrain.stages.__file__.startswith(str(REPO / "stages"))
    assert growtrain.kernels.__file__.startswith(str(REPO / "kernels"))


def test_import_bitsandbytes_from_the_repo_root_does_not_import_the_project_kernels():
    code = (
        "import sys, bitsandbytes\n"
        "mods = {n: getattr(m, '__file__', '') or '' for n, m in sys.modules.items()}\n"
        f"bad = [n for n, f in mods.items() if f.startswith({str(REPO / 'kernels')!r})]\n"
        "assert not bad, f'project kernels imported as {bad}'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ok" in done.stdout


def test_kernels_import_nothing_from_growtrain():
    code = "import sys, growtrain.kernels.reference; assert 'growtrain.model' not in sys.modules and 'growtrain.stages' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_top_level_import_of_kernels_from_the_repo_root_reaches_the_real_pypi_package(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("WHO = 'the PyPI package'\n")
    code = "import kernels; print(kernels.WHO)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=cli_env(PYTHONPATH=str(tmp_path / "site")), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "the PyPI package"
