"""cache_dataset / CachedDataset / presize_images: round trip, copies, crash-safe
resume, corruption, clear errors, no XLA runtime, and training from a cache."""

import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from conftest import run_python
from tpu_utility import CachedDataset, cache_dataset, make_sampler, one_cycle_fit, presize_images

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


class Plain(Dataset):
    """Deterministic samples: a uint8 image, an int label, a float label."""

    def __init__(self, n=50):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = (torch.arange(3 * 8 * 8) * (i + 1) % 251).to(torch.uint8).reshape(3, 8, 8)
        return image, i % 7, i / 3.0


class Augmented(Plain):
    """Plain plus random noise, drawn from torch's global RNG like torchvision transforms."""

    def __getitem__(self, i):
        image, label, value = super().__getitem__(i)
        return image.float() + torch.rand(3, 8, 8), label, value


def test_round_trip_over_several_shards(tmp_path):
    ds = Plain()
    cache_dataset(ds, str(tmp_path), shard_mb=0.001, progress=False)  # about 5 samples per shard
    shards = [n for n in os.listdir(tmp_path) if n.endswith("-f0.npy")]
    assert 5 <= len(shards) <= 20
    cached = CachedDataset(str(tmp_path), verify=True)
    assert len(cached) == len(ds)
    for i in range(len(ds)):
        image, label, value = cached[i]
        want = ds[i]
        assert torch.equal(image, want[0]) and image.dtype == torch.uint8
        assert label == want[1] and isinstance(label, int)
        assert value == want[2] and isinstance(value, float)


def test_copies_serve_a_different_augmentation_each_epoch(tmp_path):
    cache_dataset(Augmented(12), str(tmp_path), copies=3, progress=False)
    cached = CachedDataset(str(tmp_path))
    images = []
    for epoch in range(4):
        cached.set_epoch(epoch)
        images.append(cached[5][0])
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])
    assert torch.equal(images[0], images[3])  # epoch 3 serves copy 0 again
    base = Plain(12)[5][0].float()
    assert all(((im - base) >= 0).all() and ((im - base) < 1).all() for im in images)  # real augmentations


BUILD_SCRIPT = """
import os, signal, sys, torch
from torch.utils.data import Dataset
from tpu_utility import cache_dataset

calls = 0
class Noisy(Dataset):
    def __len__(self):
        return 60
    def __getitem__(self, i):
        global calls
        calls += 1
        if calls == int(os.environ.get("KILL_AT_CALL", -1)):
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.rand(4, 4) + i, i % 3

cache_dataset(Noisy(), sys.argv[1], copies=2, shard_mb=0.0005, progress=False)
print("calls", calls, "torch_xla loaded", "torch_xla" in sys.modules)
"""


def _build(folder, kill_at=None):
    env = {"KILL_AT_CALL": str(kill_at)} if kill_at is not None else {}
    return run_python(f"import sys; sys.argv = ['build', {str(folder)!r}]\n" + BUILD_SCRIPT, env=env)


def _files(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_a_killed_build_resumes_to_identical_files_without_touching_xla(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = _build(straight)
    assert r.returncode == 0, r.stderr
    assert "torch_xla loaded False" in r.stdout  # no XLA import, so no runtime either
    # Killed while fingerprinting the source, in copy 0, then again in copy 1 (each run counts from 1).
    for kill_at in (20, 60, 110):
        r = _build(killed, kill_at=kill_at)
        assert r.returncode == -9, r.stderr
        assert "manifest.json" not in os.listdir(killed)
    with pytest.raises(FileNotFoundError, match=r"manifest.json is missing: .* is an interrupted build"):
        CachedDataset(str(killed))
    r = _build(killed)
    assert r.returncode == 0, r.stderr
    calls = int(r.stdout.split("calls ")[1].split()[0])
    assert calls < 60 * 2, "the resumed build redid finished shards"
    assert _files(killed) == _files(straight)  # byte-identical, manifest included; no temporaries or lock left


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corruption_and_missing_files_are_named(tmp_path):
    cache_dataset(Plain(20), str(tmp_path), shard_mb=0.001, progress=False)
    shard = tmp_path / sorted(n for n in os.listdir(tmp_path) if n.endswith(".npy"))[1]
    _flip_last_byte(shard)
    with pytest.raises(ValueError, match=rf"{shard.name} does not match its checksum"):
        CachedDataset(str(tmp_path), verify=True)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shard.name} is missing"):
        CachedDataset(str(tmp_path))


class Ragged(Plain):
    def __getitem__(self, i):
        return torch.zeros(3, 8 + i % 2, 8), 0


class Strings(Plain):
    def __getitem__(self, i):
        return torch.zeros(2), "cat"


class PilImages(Plain):
    def __getitem__(self, i):
        return Image.new("RGB", (8, 8)), 0


def test_bad_inputs_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"sample 1, part 0 has shape \(3, 9, 8\) but sample 0 has \(3, 8, 8\).*presize_images"):
        cache_dataset(Ragged(), str(tmp_path / "ragged"), progress=False)
    with pytest.raises(TypeError, match=r"sample 0, part 1 is a str"):
        cache_dataset(Strings(), str(tmp_path / "strings"), progress=False)
    with pytest.raises(TypeError, match=r"sample 0, part 0 is a Image.*PILToTensor"):
        cache_dataset(PilImages(), str(tmp_path / "pil"), progress=False)
    with pytest.raises(ValueError, match=r"dataset is empty"):
        cache_dataset(Plain(0), str(tmp_path / "empty"), progress=False)
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "holiday.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"exists and holds something else \(holiday.jpg\)"):
        cache_dataset(Plain(), str(tmp_path / "photos"), progress=False)


def test_cached_digits_train_with_one_cycle_fit_and_workers(tmp_path, digits):
    train, valid = digits
    cache_dataset(train, str(tmp_path), copies=2, progress=False)
    cached = CachedDataset(str(tmp_path))
    assert make_sampler(cached) is None  # one replica
    batch = next(iter(DataLoader(cached, batch_size=16, num_workers=2)))
    assert batch[0].shape == (16, 1, 8, 8)
    history = one_cycle_fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)), cached,
                            valid_data=valid, epochs=3, max_lr=3e-2, batch_size=32, progress=False)  # fmt: skip
    assert cached.epoch == 2  # one_cycle_fit called set_epoch
    assert history.records[-1].metrics["accuracy"] > 0.9


def _image_folder(root):
    rng = np.random.default_rng(0)
    sizes = {"cat": [(40, 30), (30, 50)], "dog": [(64, 64), (50, 20)]}
    for label, dims in sizes.items():
        (root / label).mkdir(parents=True)
        for k, (w, h) in enumerate(dims):
            pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / label / f"{k}.png")
            Image.fromarray(pixels).save(root / label / f"{k}.jpg", quality=90)
    (root / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")


def test_presize_keeps_structure_skips_done_files_and_reports_corrupt_ones(tmp_path):
    from torchvision.datasets import ImageFolder

    src, dst = tmp_path / "src", tmp_path / "dst"
    _image_folder(src)
    report = presize_images(str(src), str(dst), 16, workers=2, progress=False)
    assert (report.written, report.skipped) == (8, 0)
    assert [os.path.basename(p) for p, _ in report.failed] == ["broken.jpg"]
    assert "broken.jpg" in str(report)
    for label in ("cat", "dog"):
        for name in os.listdir(dst / label):
            with Image.open(dst / label / name) as img:
                assert min(img.size) == 16
    with Image.open(dst / "cat" / "1.png") as img:
        assert img.size == (16, round(50 * 16 / 30))  # aspect kept
    folder = ImageFolder(str(dst))
    assert folder.classes == ["cat", "dog"] and len(folder) == 8
    stamps = {p: os.stat(dst / p).st_mtime_ns for p in ("cat/0.png", "dog/1.jpg")}
    again = presize_images(str(src), str(dst), 16, workers=2, progress=False)
    assert (again.written, again.skipped, len(again.failed)) == (0, 8, 1)
    assert stamps == {p: os.stat(dst / p).st_mtime_ns for p in stamps}  # untouched
    square = presize_images(str(src), str(tmp_path / "sq"), 12, mode="crop", workers=1, progress=False)
    assert square.written == 8
    with Image.open(tmp_path / "sq" / "dog" / "1.jpg") as img:
        assert img.size == (12, 12)


def test_presize_argument_errors(tmp_path):
    with pytest.raises(ValueError, match=r"mode must be one of \('short_side', 'crop'\), but given 'fit'"):
        presize_images(str(tmp_path), str(tmp_path / "o"), 16, mode="fit")
    with pytest.raises(ValueError, match=r"dst_dir .* must be outside src_dir"):
        presize_images(str(tmp_path), str(tmp_path / "o"), 16)
    with pytest.raises(FileNotFoundError, match=r"src_dir .*nope.* is not a folder"):
        presize_images(str(tmp_path / "nope"), str(tmp_path / "o"), 16)


def test_the_readme_recipe_uint8_cache_with_normalize_in_the_model(tmp_path, digits):
    from torchvision.transforms import v2

    train, valid = digits

    class AsUint8(Dataset):  # stands in for an ImageFolder + PILToTensor pipeline
        def __init__(self, ds):
            self.ds = ds

        def __len__(self):
            return len(self.ds)

        def __getitem__(self, i):
            x, y = self.ds[i]
            return (x * 255).to(torch.uint8), int(y)

    cache_dataset(AsUint8(train), str(tmp_path), progress=False)
    model = torch.nn.Sequential(
        v2.ToDtype(torch.float32, scale=True), v2.Normalize((0.3,), (0.4,)),  # on the device
        torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    )  # fmt: skip
    history = one_cycle_fit(model, CachedDataset(str(tmp_path)), valid_data=AsUint8(valid), epochs=3,
                            max_lr=1e-2, batch_size=32, progress=False)  # fmt: skip
    assert history.records[0].compiles == history.records[-1].compiles
    assert history.records[-1].metrics["accuracy"] > 0.9
