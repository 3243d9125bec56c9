"""The pytest plugin: assert_shared_prefix, the prefix_fingerprint fixture, golden updates."""

from __future__ import annotations

import json
import textwrap

import pytest

from kvreuse.testing.prefix import assert_shared_prefix
from kvreuse.tokenizers import load_tokenizer

pytest_plugins = ["pytester"]

STABLE = "You are the assistant of Example Books.\n" * 30


def test_shared_prefix_passes_and_returns_the_shared_length() -> None:
    """Prompts that differ only after n tokens pass; the shared token count is returned."""
    shared = assert_shared_prefix(STABLE + "Where?", STABLE + "When?", "cl100k_base", n=224)
    assert shared == len(load_tokenizer("cl100k_base").tokenizer.encode(STABLE))


def test_failure_shows_a_readable_token_diff() -> None:
    """A timestamp early in the prompt fails with the position, the tokens and the text."""
    tokenizer = load_tokenizer("cl100k_base")
    with pytest.raises(AssertionError) as failure:
        assert_shared_prefix(
            "Time: 09:15:02\n" + STABLE, "Time: 09:15:07\n" + STABLE, tokenizer, n=128
        )
    message = str(failure.value)
    assert "first difference at token" in message
    assert "'02'" in message and "'07'" in message
    assert "a block cache of 16 reuses 0" in message


def test_token_ids_need_no_tokenizer() -> None:
    """Lists of ids compare directly; the diff then shows ids."""
    with pytest.raises(AssertionError, match="first difference at token 2"):
        assert_shared_prefix([1, 2, 3, 4], [1, 2, 9, 4], n=4)


def test_plugin_fixtures_and_golden_update(pytester: pytest.Pytester) -> None:
    """prefix_fingerprint fails without a golden, records it with --kvreuse-update-golden,
    passes after, and fails with the cause when the prompt changes."""
    pytester.makeini("[pytest]\nkvreuse_golden_dir = golden\n")
    pytester.makepyfile(
        test_prompts=textwrap.dedent(
            """
            SYSTEM = "You are the assistant of Example Books.\\n" * 30

            def test_stable(prefix_fingerprint, assert_shared_prefix):
                assert_shared_prefix(SYSTEM + "a", SYSTEM + "b", "cl100k_base", n=128)
                prefix_fingerprint("system", SYSTEM + "question", "cl100k_base", n=128)
            """
        )
    )
    first = pytester.runpytest("-p", "no:cacheprovider")
    first.assert_outcomes(failed=1)
    first.stdout.fnmatch_lines(["*--kvreuse-update-golden*"])
    pytester.runpytest("-p", "no:cacheprovider", "--kvreuse-update-golden").assert_outcomes(
        passed=1
    )
    golden = json.loads((pytester.path / "golden" / "test_prompts.json").read_text())
    assert list(golden) == ["test_stable::system"]
    assert golden["test_stable::system"]["tokens"] == 128
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    changed = pytester.makepyfile(
        test_prompts=textwrap.dedent(
            """
            SYSTEM = "You are the assistant of Example Books (v2).\\n" * 30

            def test_stable(prefix_fingerprint):
                prefix_fingerprint("system", SYSTEM + "question", "cl100k_base", n=128)
            """
        )
    )
    assert changed.exists()
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the tokens changed; first changed block 0*"])
