"""`tandem serve` runs on tcmalloc (re-executed once with it preloaded, same PID), on glibc's
malloc with `--allocator system`, and falls back to it, saying so, where tcmalloc is missing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tandem.launch import allocator
from tests.inference.server_utils import ServerProcess


def _mapped(pid: int) -> bool:
    return "/libtcmalloc_minimal" in Path(f"/proc/{pid}/maps").read_text()


def test_this_machine_has_tcmalloc():
    """The tests below would otherwise pass on glibc's malloc alone."""
    assert allocator.find() is not None, "libtcmalloc_minimal is not installed: make test-deps installs it"


@pytest.mark.parametrize("choice, expected", [((), True), (("--allocator", "system"), False)],
                         ids=["default", "system"])
def test_the_server_process_runs_on_the_chosen_allocator(qwen3_dir, tmp_path, choice, expected):
    server = ServerProcess(qwen3_dir, tmp_path, *choice)
    try:
        assert server.proc.poll() is None and server.get("/health")[0] == 200
        assert _mapped(server.pid) is expected  # the re-exec kept the PID the launcher knows
    finally:
        server.stop()


def test_no_tcmalloc_is_a_logged_fallback(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "loaded", lambda: False)
    monkeypatch.setattr(allocator, "find", lambda: None)
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("must not re-exec without a library"))
    monkeypatch.delenv(allocator.ENV_GUARD, raising=False)
    with caplog.at_level(logging.WARNING, logger="tandem.launch.allocator"):
        allocator.reexec_with_allocator("tcmalloc")
    assert "libtcmalloc-minimal4" in caplog.text and "--allocator system" in caplog.text


def test_a_preload_that_did_not_take_is_not_retried(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "loaded", lambda: False)
    monkeypatch.setattr(allocator.os, "execve", lambda *a: pytest.fail("re-exec loop"))
    monkeypatch.setenv(allocator.ENV_GUARD, "1")
    with caplog.at_level(logging.WARNING, logger="tandem.launch.allocator"):
        allocator.reexec_with_allocator("tcmalloc")
    assert "not mapped" in caplog.text


def test_an_unknown_choice_names_the_flag():
    with pytest.raises(ValueError, match="--allocator 'jemalloc'"):
        allocator.reexec_with_allocator("jemalloc")
