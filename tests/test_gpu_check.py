"""make gpu-check (bench/gpu_check.py): the one command a lent GPU runs. Here, without CUDA, its dry run: the same
code at small shapes on the CPU, so that the script a 15-minute loan depends on cannot rot between loans."""

import importlib.util
import os

from conftest import ROOT, run_python

BACKEND_BEFORE = os.environ.get("TPU_UTILITY_BACKEND")


def test_the_gpu_check_dry_run_collects_every_cuda_test_and_fills_the_table():
    r = run_python(f"import runpy, sys; sys.argv = ['gpu_check.py', '--dry-run']; "
                   f"runpy.run_path({os.path.join(ROOT, 'bench', 'gpu_check.py')!r}, run_name='__main__')",
                   env={"PJRT_DEVICE": None})  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "a dry run on the CPU at small shapes" in out and ", 0 failed," in out, out[-3000:]
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)  # its import changes nothing in this process (no environment, no sys.path)

    every = [(path, line) for path in gpu_check.cuda_test_files() for line in open(os.path.join(ROOT, path))
             if line.strip() == "@pytest.mark.cuda"]  # fmt: skip
    assert len(every) >= 9 and out.count("not run: no CUDA") == len(every), out  # each CUDA-marked test, collected
    assert "one_cycle_fit compiled / compiled hand loop" in out and "<= 1.03" in out
    assert out.count("tokens equal") == 2 and "12 of 12 prompts' tokens equal" in out
    assert "TPU_UTILITY_BACKEND" not in os.environ or os.environ["TPU_UTILITY_BACKEND"] == BACKEND_BEFORE
