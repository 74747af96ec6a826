"""`./dev detect`: the CUDA extra `./dev setup` installs, from a stand-in `nvidia-smi` put first on PATH (12.x and
13.x drivers, an old one, a failing one), without one (the CPU case), and the `JAX_LATENT_EP_CUDA` override; and
`JAX_LATENT_EP_PYTHON`, an interpreter used as it is."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
"""


def _stand_in(bin_dir: pathlib.Path, driver: str, cuda: str, gpus: int = 2, fail: bool = False):
    bin_dir.mkdir(parents=True, exist_ok=True)
    listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i:08d})\\n" for i in range(gpus))
    body = "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9" if fail else (
        f'if [ "${{1:-}}" = -L ]; then printf "{listing}"; exit 0; fi\n'
        f"cat <<'EOF'\n{HEADER.format(driver=driver, cuda=cuda)}EOF")
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def _detect(path_dirs, **env) -> tuple[int, str, str]:
    # PATH: the stand-in (if any), then only what bash and the script need (no real nvidia-smi can leak in).
    tools = pathlib.Path(shutil.which("grep")).parent
    run_env = {"PATH": os.pathsep.join([*map(str, path_dirs), str(tools), "/bin", "/usr/bin"]), "HOME": "/tmp", **env}
    done = subprocess.run(["bash", str(REPO / "dev"), "detect"], env=run_env, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout.strip(), done.stderr


@pytest.fixture
def no_real_driver():
    for d in ("/bin", "/usr/bin", str(pathlib.Path(shutil.which("grep")).parent)):
        if (pathlib.Path(d) / "nvidia-smi").exists():
            pytest.skip(f"a real nvidia-smi is in {d}")


@pytest.mark.parametrize("driver, cuda, extra", [
    ("580.65.06", "13.0", "cuda13"),
    ("590.10", "13.1", "cuda13"),
    ("570.133.20", "12.8", "cuda12"),
    ("535.104.05", "12.2", "cuda12"),
])
def test_driver_picks_the_extra(tmp_path, no_real_driver, driver, cuda, extra):
    _stand_in(tmp_path / "bin", driver, cuda, gpus=2)
    rc, out, err = _detect([tmp_path / "bin"])
    assert rc == 0, err
    assert out == f"{extra}: NVIDIA driver {driver} supports CUDA {cuda} (2 GPU(s))", out


def test_old_or_failing_driver_is_cpu(tmp_path, no_real_driver):
    _stand_in(tmp_path / "old", "470.82", "11.4")
    rc, out, _ = _detect([tmp_path / "old"])
    assert rc == 0 and out.startswith("cpu: NVIDIA driver 470.82 supports CUDA 11.4 only"), out
    _stand_in(tmp_path / "bad", "", "", fail=True)
    rc, out, _ = _detect([tmp_path / "bad"])
    assert rc == 0 and out.startswith("cpu: nvidia-smi failed (NVIDIA-SMI has failed"), out


def test_no_driver_is_cpu(no_real_driver):
    rc, out, _ = _detect([])
    assert (rc, out) == (0, "cpu: no NVIDIA driver found (nvidia-smi is not on PATH): CPU only")


@pytest.mark.parametrize("value, first", [("cpu", "cpu"), ("none", "cpu"), ("cuda12", "cuda12"), ("cuda13", "cuda13")])
def test_override_wins_over_the_driver(tmp_path, value, first):
    _stand_in(tmp_path / "bin", "580.65.06", "13.0")
    rc, out, _ = _detect([tmp_path / "bin"], JAX_LATENT_EP_CUDA=value)
    assert rc == 0 and out == f"{first}: " + (f"JAX_LATENT_EP_CUDA={value}" + (": CPU only" if first == "cpu" else "")), out


def test_bad_override_is_refused(tmp_path):
    rc, out, err = _detect([], JAX_LATENT_EP_CUDA="rocm")
    assert rc == 2 and out == "" and "JAX_LATENT_EP_CUDA=rocm: expected cpu, cuda12, cuda13 or auto" in err


def test_python_override_runs_as_is(tmp_path):
    """`JAX_LATENT_EP_PYTHON`: demo / test run with that interpreter and the source tree on PYTHONPATH, with no
    venv made and nothing installed (a machine with JAX preinstalled and no package index)."""
    import sys

    venv = tmp_path / "no-venv"
    env = {**os.environ, "JAX_LATENT_EP_PYTHON": sys.executable, "JAX_LATENT_EP_VENV": str(venv)}
    done = subprocess.run(["bash", str(REPO / "dev"), "test", "-c", "/dev/null", "--co", "-q", "-p", "no:cacheprovider",
                           str(REPO / "tests" / "test_dev.py")], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "test_python_override_runs_as_is" in done.stdout
    assert not venv.exists(), "a venv was made"


def test_python_override_without_jax_is_refused(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    done = subprocess.run(["bash", str(REPO / "dev"), "demo"], env={**os.environ, "JAX_LATENT_EP_PYTHON": str(fake)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and f"JAX_LATENT_EP_PYTHON={fake} cannot import jax" in done.stderr, done.stderr
