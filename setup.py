from setuptools import find_packages, setup

setup(
    name="tpu_utility",
    version="0.1.0",
    description="Move a PyTorch training loop from CUDA to TPUs (torch_xla) with a few edited lines.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpu_utility", "tpu_utility.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.5", "torchvision", "pillow", "tqdm", "matplotlib", "numpy"],
    extras_require={
        # torch_xla pins torch exactly: install the torch_xla matching your torch.
        "xla": ["torch_xla"],
        "tpu": ["torch_xla[tpu]"],
    },
)
