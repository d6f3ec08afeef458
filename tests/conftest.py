import os
import sys
from pathlib import Path

import pytest

# Tests never reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_pair_paths(tmp_path_factory):
    from tinypair import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """The packaged toy pair installed as `make toy` installs it (large/, small/, corpus/), once per session."""
    from kvlingo.toy import train as toytrain

    out = tmp_path_factory.mktemp("toy_pair") / "toy"
    toytrain.install_pair(out, log=lambda _msg: None)
    return out


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: several jobs share two cores, and OpenMP spinning costs far more."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
