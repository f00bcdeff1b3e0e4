"""python -m tpu_utility.check passes on 1 and 4 XLA:CPU devices and without torch_xla, and a
failed check gives exit code 1 and its traceback in the report."""

import pytest

from conftest import BLOCK_TORCH_XLA, run_python

RUN = "import runpy; runpy.run_module('tpu_utility.check', run_name='__main__')"  # python -m tpu_utility.check


def _lines(stdout):
    return {line.split(":")[0].split(None, 1)[1]: line for line in stdout.splitlines()
            if line.startswith(("ok ", "FAILED ", "skipped "))}  # fmt: skip


@pytest.mark.parametrize("devices", [1, pytest.param(4, marks=pytest.mark.multidevice)])
def test_the_check_passes_on_xla_cpu(devices):
    r = run_python(RUN, env={"CPU_NUM_DEVICES": str(devices)}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _lines(r.stdout)
    assert "result: 4 ok, 0 failed, 2 skipped" in r.stdout
    assert f"CPU XLA:CPU x {devices} via XLA" in r.stdout and "torch_xla 2." in r.stdout  # the platform lines
    # the rules table's 1.x names that raise on this release, with the tool that rewrites them
    assert "refuses these 1.x calls: xm.xrt_world_size(), xm.get_ordinal(), xmp.spawn(..., nprocs=8)" in r.stdout
    assert lines["one-core one_cycle_fit"].startswith("ok ")
    assert "host syncs in each epoch [0, 0, 0]" in lines["one-core one_cycle_fit"]
    assert lines["all-core one_cycle_fit"].startswith(f"ok       all-core one_cycle_fit: {devices} core(s)")
    assert ("SPMD" in lines["all-core one_cycle_fit"]) == (devices > 1)
    assert lines["predict in order"].startswith("ok ")
    assert lines["checkpoint"].startswith("ok ") and "from xla:0" in lines["checkpoint"]
    assert lines["bf16 autocast"].startswith("skipped  bf16 autocast: xla:0 has no bf16 autocast")
    assert lines["compile cache"].startswith("skipped  compile cache: TPU only")


def test_the_check_passes_without_torch_xla():
    r = run_python(BLOCK_TORCH_XLA + RUN, env={"PJRT_DEVICE": None}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = _lines(r.stdout)
    assert "torch_xla not installed" in r.stdout
    assert all(lines[name].startswith("ok ") for name in ("one-core one_cycle_fit", "all-core one_cycle_fit",
                                                          "predict in order", "checkpoint"))  # fmt: skip
    assert "compiles so far" not in r.stdout  # no XLA counters to read
    assert lines["bf16 autocast"].startswith("ok       bf16 autocast: bf16 (autocast) on cpu")
    assert lines["compile cache"].startswith("skipped ")


def test_a_failed_check_gives_exit_code_1_and_its_traceback(monkeypatch, capsys):
    import tpu_utility
    from tpu_utility import check as check_module  # the function, re-exported

    module = __import__("sys").modules["tpu_utility.diagnostics.check"]

    def predict_out_of_order():
        raise module.CheckFailed("3 of 1001 rows are not model(sample i), the first at [7, 8, 9]")

    monkeypatch.setattr(module, "CHECKS", [("predict in order", predict_out_of_order), *module.CHECKS[-1:]])
    assert tpu_utility.check is check_module and callable(check_module)
    assert module.main() == 1
    out = capsys.readouterr().out
    assert "FAILED   predict in order: CheckFailed: 3 of 1001 rows are not model(sample i)" in out
    assert "--- predict in order failed:\nTraceback" in out and "in predict_out_of_order" in out
    assert "result: 0 ok, 1 failed, 1 skipped" in out
