"""pytest plugin (entry point ``pytest11``): prefix-stability checks in any project's tests.

* ``assert_shared_prefix(a, b, tokenizer, n=2048)``: importable from
  :mod:`kvreuse.testing.prefix`, and as a fixture of the same name;
* ``prefix_fingerprint(name, prompt, tokenizer, n=2048)``: compares the prompt's leading-token
  fingerprint with a golden file per test module (``<kvreuse_golden_dir>/<module>.json``);
* ``--kvreuse-update-golden``: record or refresh those goldens instead of failing.

Imports of kvreuse happen inside the fixtures so that loading the plugin costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR_DEFAULT = "tests/golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvreuse", "kvreuse prefix-stability checks")
    group.addoption(
        "--kvreuse-update-golden",
        action="store_true",
        default=False,
        help="record or refresh golden prefix fingerprints instead of failing on a change",
    )
    parser.addini(
        "kvreuse_golden_dir",
        "directory (relative to the rootdir) holding golden prefix fingerprints",
        default=GOLDEN_DIR_DEFAULT,
    )


@pytest.fixture
def assert_shared_prefix() -> Callable[..., int]:
    """The :func:`kvreuse.testing.prefix.assert_shared_prefix` function."""
    from kvreuse.testing.prefix import assert_shared_prefix as check

    return check


@pytest.fixture
def prefix_fingerprint(request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``prefix_fingerprint(name, prompt, tokenizer=None, n=2048, block_size=16,
    revisions=None)`` -> the fingerprint; fails when it differs from the golden one."""
    from kvreuse.testing.prefix import GoldenFingerprints

    config = request.config
    directory = Path(str(config.rootpath)) / str(config.getini("kvreuse_golden_dir"))
    module = Path(str(request.node.path)).stem
    store = GoldenFingerprints(
        directory / f"{module}.json", bool(config.getoption("kvreuse_update_golden"))
    )

    def check(name: str, prompt: Any, tokenizer: Any = None, **options: Any) -> Any:
        return store.check(f"{request.node.name}::{name}", prompt, tokenizer, **options)

    yield check
    store.save()
