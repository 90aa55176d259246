import json
import os
from pathlib import Path

import pytest

from specbench.tiny import save_tiny_hf  # noqa: F401 - the tiny target (shared with specbench.audit)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = save_tiny_hf(root / "target", seed=0)
    draft = save_tiny_hf(root / "draft", seed=3)
    other = save_tiny_hf(root / "other_vocab", seed=3, shift=1000)
    qs = root / "questions.jsonl"
    with qs.open("w") as f:
        for i in range(5):
            words = " ".join(f"w{(i * 7 + j * 3) % 90}" for j in range(4 + 2 * i))
            f.write(json.dumps({"question_id": i, "category": "cat" + str(i % 2), "turns": [words, "w5 w6 w7"]}) + "\n")
    return {"target": target, "draft": draft, "other": other, "questions": qs, "root": root}


# Modules whose tests decode, verify, commit and join rows on ``SPECBENCH_TEST_DEVICE`` (helpers.DEVICE):
# with a GPU device only these run (the others hold CPU kernels, files and analysis to the CPU).
PORTABLE = {"test_engine", "test_verify", "test_serving", "test_feature_methods", "test_search_methods",
            "test_training_free", "test_synthetic", "test_gpu", "test_device"}


@pytest.fixture(scope="session")
def device():
    """The device the decode tests run on: ``SPECBENCH_TEST_DEVICE`` (default cpu)."""
    from helpers import DEVICE

    return DEVICE


def pytest_collection_modifyitems(config, items):
    from helpers import DEVICE

    cuda = __import__("torch").cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (the gpu marker)"))
        elif DEVICE.type != "cpu" and item.module.__name__ not in PORTABLE:
            item.add_marker(pytest.mark.skip(reason=f"CPU-only module (SPECBENCH_TEST_DEVICE={DEVICE} runs "
                                                    "the device-portable ones)"))


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path_factory, monkeypatch):
    # unit tests get an empty cache dir; slow tests share the user's converted models
    if "SPECBENCH_CACHE" not in os.environ and request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def pytest_configure(config):
    """The run's schema and every method's settings in Hydra's config store, as ``python -m specbench``
    puts them there, for the tests that compose a run config."""
    from specbench.run import schema

    schema.store()
