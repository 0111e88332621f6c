"""Where the tests find the checkout and the shared scenario files beside it."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A file of ../shared; in CI its absence is a failure, elsewhere a skip."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{path} is missing: CI must run beside ../shared")
        pytest.skip(f"{path} is not here")
    return path
