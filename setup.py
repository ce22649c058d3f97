"""T1: actor-critic RL for LLM agents on long-horizon terminal tasks (TITO + R3 on MoE policies)."""

from setuptools import find_packages, setup

setup(
    name="t1",
    version="0.1.0",
    description="Warm-started PPO for MoE agents in Docker sandboxes, with exact-token training and routing replay",
    python_requires=">=3.10",
    # Import names of our own (tests/test_packaging.py checks that no other installed distribution provides one):
    # Hugging Face's `kernels`, which transformers imports, is why ours is `t1kernels`. tests/ and bench/ run
    # from the checkout and are never installed as top-level packages.
    packages=find_packages(include=["t1config", "t1config.*", "t1kernels", "t1kernels.*", "t1model", "t1model.*",
                                    "t1core", "t1core.*", "rollout", "rollout.*", "sandbox", "sandbox.*", "t1cli",
                                    "t1cli.*"]),
    package_data={"t1model": ["assets/*", "assets/**/*"], "t1core": ["configs/*.toml"]},
    # One command for every tool: `t1 train|plan|eval|tasks|reap|report|mismatch` (t1cli.main; `python -m t1cli`
    # runs the same without the script).
    entry_points={"console_scripts": ["t1=t1cli.main:main"]},
    install_requires=[
        # torch: install the build for your machine first (scripts/setup.sh takes the CPU wheel on CPU boxes);
        # a floor here so that an existing install is kept and no CUDA build is pulled in.
        "torch>=2.4",
        # [ssh]: paramiko, which the SDK imports for any ssh:// host even when it runs the `ssh` binary, as
        # sandbox.runtime.host_spec has it do (ssh_config, agent and known_hosts as the user's own ssh).
        "docker[ssh]>=7.0",
        "tokenizers>=0.19",
        "safetensors>=0.4",
        "numpy>=1.24",
        "tqdm>=4.60",
        "matplotlib>=3.7",
        "tomli>=2.0; python_version < '3.11'",
        "pyyaml>=6.0",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        # vllm: rollout/vllm_engine.py was written against 0.33 (routed_experts_prompt_start, trainer-side
        # weight-transfer engines); rollout.vllm_api.SUPPORTED holds the same range.
        # locks/gpu.txt pins the set (vllm 0.33.0 requires torch==2.14.0; install that torch first, README).
        "gpu": ["triton>=3.0", "vllm>=0.33,<0.34", "nvidia-ml-py>=12.0"],
        # flash-attn compiles against the installed CUDA torch: its own extra, installed last with
        # --no-build-isolation (t1model.attention uses it when importable, else SDPA).
        "flash": ["flash-attn>=2.6"],
        # msgspec: tests/fake_vllm.py encodes payloads as vLLM's collective_rpc does. The rest are what the real
        # vLLM 0.33 modules of the vllm_real lane import on a CPU (tests/test_vllm_real.py; vLLM itself is not
        # installed: its wheel would bring a CUDA torch).
        "dev": ["triton>=3.0", "pytest>=8.0", "pytest-benchmark>=4.0", "transformers>=4.51", "msgspec", "pyzmq",
                "cbor2", "psutil", "pybase64", "cachetools", "py-cpuinfo", "aiohttp", "openai", "openai-harmony",
                "uvloop", "prometheus_client", "cloudpickle"],
    },
)
