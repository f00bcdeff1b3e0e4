from os.path import exists, join, basename
from os import makedirs
from torchvision.transforms import Compose, CenterCrop, ToTensor, Resize

from dataset import DatasetFromFolder


def download_bsd300(dest="dataset"):
    # tpu_utility tests: BSDS300's download became 8 train and 4 test images of 32x32 generated here, in the
    # folders the download made (and `from six.moves import urllib`, `tarfile` and `remove` went with it)
    output_image_dir = join(dest, "BSDS300/images")

    if not exists(output_image_dir):
        import numpy as np
        from PIL import Image
        rng = np.random.RandomState(0)
        for split, n in (("train", 8), ("test", 4)):
            makedirs(join(output_image_dir, split))
            for i in range(n):
                Image.fromarray(rng.randint(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    join(output_image_dir, split, "%d.png" % i))

    return output_image_dir


def calculate_valid_crop_size(crop_size, upscale_factor):
    return crop_size - (crop_size % upscale_factor)


def input_transform(crop_size, upscale_factor):
    return Compose([
        CenterCrop(crop_size),
        Resize(crop_size // upscale_factor),
        ToTensor(),
    ])


def target_transform(crop_size):
    return Compose([
        CenterCrop(crop_size),
        ToTensor(),
    ])


def get_training_set(upscale_factor):
    root_dir = download_bsd300()
    train_dir = join(root_dir, "train")
    crop_size = calculate_valid_crop_size(24, upscale_factor)  # tpu_utility tests: 256 in the original

    return DatasetFromFolder(train_dir,
                             input_transform=input_transform(crop_size, upscale_factor),
                             target_transform=target_transform(crop_size))


def get_test_set(upscale_factor):
    root_dir = download_bsd300()
    test_dir = join(root_dir, "test")
    crop_size = calculate_valid_crop_size(24, upscale_factor)  # tpu_utility tests: 256 in the original

    return DatasetFromFolder(test_dir,
                             input_transform=input_transform(crop_size, upscale_factor),
                             target_transform=target_transform(crop_size))
