from setuptools import find_packages, setup

setup(
    name="stree",
    version="0.1.0",
    description="Speculative tree decoding for Mamba2 and hybrid SSM/attention language models (Triton kernels)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["stree", "stree.*"]),
    package_data={"stree": ["assets/*/*.json", "assets/*/*.jsonl", "assets/*/*.safetensors", "kernels/cpu/*.cpp"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.2",
        "einops",
        # 5.23: Mamba2's gated RMSNorm per group, as mamba_ssm; 5.25: Nemotron-H's dt clamp read from time_step_limit
        "transformers>=5.25",
        "safetensors",
        "numpy",
        "numba",  # the n-gram drafter's compiled index (stree/drafters/ngram_jit.py)
        "tqdm",
        "tokenizers",
        "math-verify",  # final answers found and compared as the reasoning-evaluation ecosystem does (stree.patterns.answers)
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "scipy", "matplotlib", "starlette", "uvicorn", "openai"],
        # `stree serve`: the ASGI app and its server
        "serve": ["starlette", "uvicorn"],
        "bench": ["matplotlib"],
        # Optional baselines for benchmarks on CUDA machines; never imported at package import time.
        "gpu": ["mamba-ssm", "causal-conv1d"],
    },
    entry_points={"console_scripts": ["stree=stree.tools.cli:entry", "stree-selfcheck=stree.tools.selfcheck:main"]},
)
