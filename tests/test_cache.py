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
print("calls", calls)
"""
IMPORTS = 'print("torch_xla loaded", "torch_xla" in sys.modules)\n'  # a fresh interpreter: the warm one holds torch_xla


def _build(folder, kill_at=None, imports=False):
    env = {"KILL_AT_CALL": str(kill_at)} if kill_at is not None else {}
    return run_python(f"import sys; sys.argv = ['build', {str(folder)!r}]\n" + BUILD_SCRIPT + (IMPORTS if imports else ""), env=env)


def _files(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_a_killed_build_resumes_to_identical_files_without_touching_xla(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = _build(straight, imports=True)
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


class Shifted(Plain):
    """The same shapes and length as Plain, other values: another data set."""

    def __getitem__(self, i):
        image, label, value = super().__getitem__(i)
        return image + 1, label, value


class FailsAt(Plain):
    def __init__(self, n, fail_at):
        super().__init__(n)
        self.fail_at = fail_at

    def __getitem__(self, i):
        if i == self.fail_at:  # not one of the samples the fingerprint reads, so the build has begun
            raise RuntimeError("disk went away")
        return super().__getitem__(i)


def test_a_cache_of_other_data_is_refused_not_served(tmp_path):
    cache_dataset(Plain(50), str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=rf"'{tmp_path}' holds a cache of other data .*manifest.json\): samples 0, 1, 3.* hold other values"):
        cache_dataset(Shifted(50), str(tmp_path), progress=False)  # today: the old cache, served as this one
    with pytest.raises(ValueError, match=r"count is 50 there, 49 now; the dataset has 50 samples there, 49 now"):
        cache_dataset(Plain(49), str(tmp_path), progress=False)
    with pytest.raises(ValueError, match=r"seed is 0 there, 1 now"):
        cache_dataset(Plain(50), str(tmp_path), seed=1, progress=False)
    assert cache_dataset(Plain(50), str(tmp_path), progress=False).endswith("manifest.json")  # the same data: reused


def test_an_interrupted_build_is_not_resumed_with_other_data(tmp_path):
    interrupted = FailsAt(50, fail_at=30)
    with pytest.raises(RuntimeError, match="disk went away"):
        cache_dataset(interrupted, str(tmp_path), shard_mb=0.001, progress=False)
    assert "build.json" in os.listdir(tmp_path) and any(n.endswith(".npy") for n in os.listdir(tmp_path))
    with pytest.raises(ValueError, match=r"holds an interrupted build of other data .*build.json\): samples 0, 1"):
        cache_dataset(Shifted(50), str(tmp_path), shard_mb=0.001, progress=False)  # today: old and new mixed
    cache_dataset(Plain(50), str(tmp_path), shard_mb=0.001, progress=False)  # the same data resumes
    cached = CachedDataset(str(tmp_path), verify=True)
    assert all(torch.equal(cached[i][0], Plain(50)[i][0]) for i in range(50))


class MixedTypes(Plain):
    def __init__(self, n, part):
        super().__init__(n)
        self.part = part

    def __getitem__(self, i):
        image, label, value = super().__getitem__(i)
        if i < 3:
            return image, label, value
        return (image.to(torch.int16), label, value) if self.part == 0 else (image, label + 0.5, value)


def test_dtypes_must_agree_across_samples(tmp_path):
    with pytest.raises(ValueError, match=r"sample 3, part 1 is float64 but sample 0 is int64; .*1.5 would become 1"):
        cache_dataset(MixedTypes(10, part=1), str(tmp_path / "labels"), progress=False)
    with pytest.raises(ValueError, match=r"sample 3, part 0 is int16 but sample 0 is uint8"):
        cache_dataset(MixedTypes(10, part=0), str(tmp_path / "images"), progress=False)


def _manifest_damage(text):
    cut = text[: len(text) // 2]
    broken_shards = text.replace('"count": 5', '"count": 6', 1)
    return {
        "truncated": cut,
        "empty": "",
        "a list": "[1, 2]",
        "binary": b"\xff\xfe\x00garbage",
        "no shards": text.replace('"shards"', '"shardz"'),
        "a shard count changed": broken_shards,
        "a shard renamed": text.replace("copy000-shard00001-f0.npy", "../../etc/passwd"),
    }


@pytest.mark.parametrize("damage", ["truncated", "empty", "a list", "binary", "no shards", "a shard count changed", "a shard renamed"])
def test_a_damaged_manifest_names_the_file(tmp_path, damage):
    cache_dataset(Plain(20), str(tmp_path), shard_mb=0.001, progress=False)  # 5 samples per shard
    manifest = tmp_path / "manifest.json"
    damaged = _manifest_damage(manifest.read_text())[damage]
    manifest.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
    with pytest.raises(ValueError, match=rf"{manifest} is damaged \(.*\); delete '{tmp_path}' and build the cache again"):
        CachedDataset(str(tmp_path))
    with pytest.raises(ValueError, match=rf"{manifest} is damaged"):
        cache_dataset(Plain(20), str(tmp_path), shard_mb=0.001, progress=False)  # not reused, not overwritten


def test_a_short_shard_is_named_without_verify_and_a_rerun_rebuilds_it(tmp_path):
    cache_dataset(Plain(20), str(tmp_path), shard_mb=0.001, progress=False)
    before = _files(tmp_path)
    shard = tmp_path / sorted(n for n in os.listdir(tmp_path) if n.endswith("-f0.npy"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"{shard} is \d+ bytes but its header says \d+: the shard is damaged"):
        CachedDataset(str(tmp_path))  # today: "mmap length is greater than file size", no file named
    cache_dataset(Plain(20), str(tmp_path), shard_mb=0.001, progress=False)
    assert _files(tmp_path) == before
    assert len(CachedDataset(str(tmp_path), verify=True)) == 20


def test_cache_files_get_the_usual_permissions_and_arguments_are_checked(tmp_path):
    old = os.umask(0o022)
    try:
        cache_dataset(Plain(5), str(tmp_path / "c"), progress=False)
    finally:
        os.umask(old)
    assert {oct(os.stat(p).st_mode & 0o777) for p in (tmp_path / "c").iterdir()} == {oct(0o644)}
    for bad, message in [({"shard_mb": float("nan")}, r"shard_mb must be a finite number > 0 .*nan"),
                         ({"shard_mb": 0}, r"shard_mb must be .*given 0"),
                         ({"shard_mb": float("inf")}, r"shard_mb must be .*given inf"),
                         ({"num_workers": -1}, r"num_workers must be an int >= 0, but given -1")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            cache_dataset(Plain(5), str(tmp_path / "d"), progress=False, **bad)
    with pytest.raises(TypeError, match=r"seed must be an int, but given 1.5 of type float"):
        cache_dataset(Plain(5), str(tmp_path / "d"), seed=1.5, progress=False)


SLOW_BUILD = """
import sys, time, torch
from torch.utils.data import Dataset
from tpu_utility import cache_dataset, CachedDataset

class Slow(Dataset):
    def __len__(self):
        return 40
    def __getitem__(self, i):
        time.sleep(0.05)
        return torch.rand(4, 4) + i, i % 3

cache_dataset(Slow(), sys.argv[1], shard_mb=0.0005, progress=False)
print("samples", len(CachedDataset(sys.argv[1], verify=True)))
"""


def test_two_builds_of_one_folder_at_once_both_succeed(tmp_path):
    import subprocess
    import sys
    import textwrap

    from conftest import ROOT

    code = f"import sys; sys.argv = ['b', {str(tmp_path / 'c')!r}]\n" + textwrap.dedent(SLOW_BUILD)
    env = {**os.environ, "PYTHONPATH": ROOT}
    builds = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]  # fmt: skip
    outputs = [b.communicate(timeout=300) for b in builds]
    for build, (out, err) in zip(builds, outputs):
        assert build.returncode == 0, err  # today: FileNotFoundError: build.json in one of them
        assert "samples 40" in out
    assert sorted(n for n in os.listdir(tmp_path / "c") if n.startswith(".")) == []  # no lock, no temporaries


class Unseedable(Plain):
    """Noise from a generator of its own, which cache_dataset's per-sample seeds cannot reach."""

    rng = np.random.default_rng()

    def __getitem__(self, i):
        image, label, value = super().__getitem__(i)
        return image, label, float(self.rng.random())


def test_a_source_that_cannot_be_seeded_is_named_and_still_cached(tmp_path):
    with pytest.warns(UserWarning, match=r"different values for one sample under one seed .*cannot be checked"):
        cache_dataset(Unseedable(12), str(tmp_path), progress=False)
    assert len(CachedDataset(str(tmp_path), verify=True)) == 12
    with pytest.warns(UserWarning, match=r"different values"):
        cache_dataset(Unseedable(12), str(tmp_path), progress=False)  # reused: only its length can be checked


def _draws():
    import random

    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_cache_dataset_leaves_the_callers_random_streams_as_they_were(tmp_path):
    import random

    def seed_all():
        torch.manual_seed(42), random.seed(42), np.random.seed(42)

    seed_all()
    without = _draws()
    seed_all()
    cache_dataset(Augmented(20), str(tmp_path / "c"), copies=2, progress=False)  # builds (plan, fingerprint, shards)
    assert _draws() == without
    seed_all()
    cache_dataset(Augmented(20), str(tmp_path / "c"), copies=2, progress=False)  # reuses (plan, fingerprint only)
    assert _draws() == without
