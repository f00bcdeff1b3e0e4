"""presize_images: formats and quality kept, modes a format cannot store, leftovers and
truncated outputs after a kill, and pool workers that do not outlive a killed parent."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from tpu_utility import presize_images
from tpu_utility.files import TEMP_SUFFIX
from tpu_utility.data.presize import _storable_mode


def _photo(w=160, h=120, seed=0):
    """A smooth picture with some noise: JPEG-like content, where quality matters."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))


def test_each_image_keeps_its_format_and_jpeg_quality_is_honoured(tmp_path):
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    _photo().save(src / "a.jpg", quality=95)
    _photo().save(src / "b.png")
    _photo().save(src / "c.webp", quality=90)
    sizes = {}
    for quality in (95, 40):
        dst = tmp_path / f"q{quality}"
        old = os.umask(0o022)
        try:
            report = presize_images(str(tmp_path / "src"), str(dst), 64, quality=quality, workers=1, progress=False)
        finally:
            os.umask(old)
        assert (report.written, report.failed) == (3, [])
        assert {oct(os.stat(p).st_mode & 0o777) for p in (dst / "cls").iterdir()} == {oct(0o644)}  # today: 0600
        for name, fmt in (("a.jpg", "JPEG"), ("b.png", "PNG"), ("c.webp", "WEBP")):
            with Image.open(dst / "cls" / name) as img:
                assert img.format == fmt and min(img.size) == 64  # today: every file is a PNG inside
        sizes[quality] = os.path.getsize(dst / "cls" / "a.jpg")
    assert sizes[40] < 0.8 * sizes[95]  # quality reaches the encoder
    with pytest.raises(ValueError, match=r"quality must be an int from 1 to 100, but given 0"):
        presize_images(str(tmp_path / "src"), str(tmp_path / "x"), 64, quality=0)
    with pytest.raises(ValueError, match=r"workers must be a positive int or None .*given 0"):
        presize_images(str(tmp_path / "src"), str(tmp_path / "x"), 64, workers=0)


def _odd_images(folder):
    folder.mkdir(parents=True)
    rgb = _photo(40, 30)
    rgb.convert("CMYK").save(folder / "cmyk.jpg")
    rgb.convert("CMYK").save(folder / "cmyk.tif")
    Image.fromarray(np.linspace(0, 1, 40 * 30, dtype=np.float32).reshape(30, 40)).save(folder / "float.tif")
    Image.fromarray((np.arange(40 * 30).reshape(30, 40) * 50).astype(np.uint16)).save(folder / "deep.png")
    rgb.convert("RGBA").save(folder / "alpha.png")
    rgb.convert("LA").save(folder / "gray_alpha.png")
    rgb.convert("P").save(folder / "palette.gif", transparency=0)
    rgb.convert("1").save(folder / "bw.bmp")


def test_modes_a_format_cannot_store_are_converted_and_every_output_loads(tmp_path):
    from torchvision.datasets import ImageFolder

    _odd_images(tmp_path / "src" / "odd")
    report = presize_images(str(tmp_path / "src"), str(tmp_path / "dst"), 20, workers=1, progress=False)
    assert report.failed == [] and report.written == 8  # today: CMYK and float images fail as PNG
    with Image.open(tmp_path / "dst" / "odd" / "float.tif") as img:
        assert img.mode == "F" and img.format == "TIFF"  # float TIFF stays float TIFF
    with Image.open(tmp_path / "dst" / "odd" / "cmyk.jpg") as img:
        assert img.format == "JPEG" and img.mode == "CMYK"
    folder = ImageFolder(str(tmp_path / "dst"))  # its default loader converts each to RGB
    assert len(folder) == 7 and all(min(folder[i][0].size) == 20 for i in range(7))  # (it skips .gif)


@pytest.mark.parametrize("mode, fmt, alpha, want", [
    ("CMYK", "PNG", False, "RGB"), ("RGBA", "JPEG", True, "RGB"), ("LA", "BMP", True, "RGBA"),
    ("F", "PNG", False, "I;16"), ("I", "JPEG", False, "L"), ("F", "TIFF", False, "F"), ("P", "PNG", True, "P"),
    ("CMYK", "JPEG", False, "CMYK"), ("HSV", "TIFF", False, "RGB"), ("YCbCr", "WEBP", False, "YCbCr"),
])  # fmt: skip
def test_storable_mode(mode, fmt, alpha, want):
    assert _storable_mode(mode, fmt, alpha) == want


def test_leftovers_are_removed_and_truncated_or_wrong_sized_outputs_redone(tmp_path):
    from torchvision.datasets import ImageFolder

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "cls").mkdir(parents=True)
    for k in range(4):
        _photo(seed=k).save(src / "cls" / f"{k}.jpg")
    assert presize_images(str(src), str(dst), 32, workers=1, progress=False).written == 4
    done = dst / "cls"
    data = (done / "0.jpg").read_bytes()
    (done / "0.jpg").write_bytes(data[: len(data) // 2])  # truncated (a copy cut short, a full disk)
    Image.new("RGB", (10, 10)).save(done / "1.jpg")  # from an earlier run at another size
    (done / ".tmp-abcd1234.jpg").write_bytes(b"")  # what today's code leaves after a kill
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = __import__("tpu_utility.files", fromlist=["_host"])._host()
    stale = done / f".2.jpg.{host}.{dead_pid}.0badf00d{TEMP_SUFFIX}"
    live = done / f".3.jpg.{host}.{os.getpid()}.0badf00d{TEMP_SUFFIX}"  # a write still under way
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    assert len(ImageFolder(str(dst))) == 5  # today's leftover is taken for a sample; ours are not
    report = presize_images(str(src), str(dst), 32, workers=1, progress=False)
    assert (report.written, report.redone, report.skipped) == (2, 2, 2)
    assert sorted(os.listdir(done)) == sorted(["0.jpg", "1.jpg", "2.jpg", "3.jpg", live.name])
    for k in range(4):
        with Image.open(done / f"{k}.jpg") as img:
            img.load()
            assert min(img.size) == 32
    assert len(ImageFolder(str(dst))) == 4


KILLED_PARENT = """
import sys
from tpu_utility import presize_images
presize_images(sys.argv[1], sys.argv[2], 48, workers=2, progress=False)
print("finished")
"""


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the pool's workers through /proc")
def test_killing_the_parent_frees_its_workers_and_a_rerun_finishes_with_nothing_lost(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "cls").mkdir(parents=True)
    for k in range(300):
        _photo(200, 150, seed=k).save(src / "cls" / f"{k:03d}.png")
    code = f"import sys; sys.argv = ['p', {str(src)!r}, {str(dst)!r}]\n" + textwrap.dedent(KILLED_PARENT)
    for wait_for in (1, 100):  # kill -9 early, then again halfway through what is left
        parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        workers = []
        try:
            deadline = time.monotonic() + 120
            before = len(os.listdir(dst / "cls")) if (dst / "cls").exists() else 0
            while time.monotonic() < deadline and parent.poll() is None:
                workers = _children(parent.pid) or workers
                written = len(os.listdir(dst / "cls")) - before if (dst / "cls").exists() else 0
                if len(workers) == 2 and written >= wait_for:
                    break
                time.sleep(0.02)
            assert parent.poll() is None and len(workers) == 2, "the run ended before it could be killed"
            parent.send_signal(signal.SIGKILL)
            parent.wait()
            deadline = time.monotonic() + 10
            while any(_alive(w) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(_alive(w) for w in workers), "pool workers outlived their killed parent"
        finally:
            for w in workers:
                if _alive(w):
                    os.kill(w, signal.SIGKILL)
    assert len([n for n in os.listdir(dst / "cls") if not n.startswith(".")]) < 300
    report = presize_images(str(src), str(dst), 48, workers=2, progress=False)
    assert report.failed == [] and report.written + report.skipped == 300
    names = os.listdir(dst / "cls")
    assert len(names) == 300 and not any(n.startswith(".") for n in names)  # no temporaries left
    for name in names:
        with Image.open(dst / "cls" / name) as img:
            img.load()
            assert min(img.size) == 48


def _small_folder(root):
    (root / "cat").mkdir(parents=True)
    (root / "dog").mkdir()
    for k in range(3):
        _photo(seed=k).save(root / "cat" / f"{k}.jpg", quality=95)
        _photo(120, 160, seed=k).save(root / "dog" / f"{k}.png")


def test_a_rerun_with_other_settings_redoes_every_output(tmp_path):
    from torchvision.datasets import ImageFolder

    src, dst = tmp_path / "src", tmp_path / "dst"
    _small_folder(src)
    first = presize_images(str(src), str(dst), 32, quality=95, workers=1, progress=False)
    assert (first.written, first.redone) == (6, 0)
    fine = (dst / "cat" / "0.jpg").stat().st_size
    lower = presize_images(str(src), str(dst), 32, quality=10, workers=1, progress=False)
    assert (lower.written, lower.redone, lower.skipped) == (6, 6, 0)  # was: all 6 skipped, still at quality 95
    assert (dst / "cat" / "0.jpg").stat().st_size < fine
    again = presize_images(str(src), str(dst), 32, quality=10, workers=1, progress=False)
    assert (again.written, again.skipped) == (0, 6)
    square = presize_images(str(src), str(dst), 32, mode="crop", quality=10, workers=1, progress=False)
    assert square.redone == 6
    with Image.open(dst / "dog" / "0.png") as img:
        assert img.size == (32, 32)
    assert len(ImageFolder(str(dst))) == 6  # the hidden settings record is not an image


def test_workers_default_to_the_usable_cpus(tmp_path, monkeypatch):
    from tpu_utility.data import presize

    sizes = []
    real = presize.ProcessPoolExecutor
    monkeypatch.setattr(presize, "usable_cpus", lambda: 1)  # a container quota of one CPU on a bigger host
    monkeypatch.setattr(presize, "ProcessPoolExecutor", lambda max_workers, **kw: sizes.append(max_workers) or real(max_workers, **kw))
    _small_folder(tmp_path / "src")
    presize_images(str(tmp_path / "src"), str(tmp_path / "dst"), 32, progress=False)
    assert sizes == [1]
