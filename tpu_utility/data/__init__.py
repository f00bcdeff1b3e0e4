"""Data preparation: shapes XLA compiles once for, preprocessing done once, and the loaders the trainer builds.

- ``buckets.py``: ``BucketCollate`` and ``BucketBatchSampler``, fixed lengths for variable-length data.
- ``cache.py``: ``cache_dataset()``, preprocess once into a memory-mapped cache.
- ``presize.py``: ``presize_images()``, shrink a folder of images once, before training.
- ``packing.py``: ``PackedDataset``, token samples packed into rows of one length (first-fit decreasing).
- ``loaders.py``: ``make_sampler()`` and the loaders, samplers and label checks the trainer uses.
"""

from .buckets import BucketBatchSampler, BucketCollate, choose_buckets, group_batches, padding_waste
from .cache import CachedDataset, cache_dataset
from .loaders import make_sampler
from .packing import PackedDataset, first_fit_decreasing
from .presize import PresizeReport, presize_images

__all__ = [
    "BucketBatchSampler",
    "BucketCollate",
    "cache_dataset",
    "CachedDataset",
    "choose_buckets",
    "group_batches",
    "first_fit_decreasing",
    "make_sampler",
    "PackedDataset",
    "padding_waste",
    "presize_images",
    "PresizeReport",
]
