"""An autouse fixture for test files whose plain-CPU reference loops run in the pytest worker: torch's eager
CPU ops on one thread while the module's tests and fixtures run, the worker's own setting given back after them.

On the suite's 2-core host, three pytest workers and their children already keep both cores busy; a second
intra-op thread per eager op only spins waiting for the other (the plain CPU loop of test_huggingface's BERT on
512 samples: 9.5 CPU-s on one thread, 21.1 on two, the same accuracy). XLA:CPU's thread pool is its own and
unaffected. Import it into a test module: ``from one_thread import one_torch_thread  # noqa: F401``.
"""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
