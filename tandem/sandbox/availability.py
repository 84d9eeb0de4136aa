"""Whether this host can isolate untrusted code: the tools are there and a tiny program, run
through the real sandbox, is pid 1 of a new PID namespace, sees no network but loopback and a cleared
environment. Checked once per bwrap binary and user; the answer (or the reason) is cached."""

from __future__ import annotations

import os
import threading

from tandem.errors import SandboxUnavailable
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import execute
from tandem.sandbox.isolation import Tools, find_tools
from tandem.sandbox.uids import UidLease

PROBE = ("import os, socket\n"
         "print(os.getpid(), ','.join(sorted(n for _, n in socket.if_nameindex())), set(os.environ) <= {'PATH', 'HOME', 'LANG', 'PWD', 'MALLOC_ARENA_MAX'})\n")
EXPECTED = "1 lo True"

_lock = threading.Lock()
_answers: dict[tuple[str, int], Tools | str] = {}


def require(config: SandboxConfig) -> Tools:
    """The tools to run with, once the self-test passed; SandboxUnavailable saying why otherwise."""
    tools = find_tools(config)
    key = (tools.bwrap, os.geteuid())
    with _lock:
        if key not in _answers:
            _answers[key] = _self_test(config, tools)
        answer = _answers[key]
    if isinstance(answer, str):
        raise SandboxUnavailable(answer)
    return answer


def _self_test(config: SandboxConfig, tools: Tools) -> Tools | str:
    probe = SandboxConfig(workers=1, cpu_s=10.0, wall_s=30.0, memory_mb=max(config.memory_mb, 128),
                          processes=4, uid_base=config.uid_base, bwrap=config.bwrap)
    try:
        with UidLease(config.uid_base, 1) as lease:
            run = execute(PROBE, None, probe, tools, lease.uids[0])
    except OSError as exc:
        return f"the sandbox's self-test could not start {tools.bwrap}: {exc}"
    if run.status == "ok" and run.stdout.strip() == EXPECTED:
        return tools
    hint = ("" if os.geteuid() == 0 else " (not root: bubblewrap needs unprivileged user namespaces, "
            "sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0)")
    return (f"the sandbox's self-test failed{hint}: {tools.bwrap} gave status {run.status}, exit code "
            f"{run.exit_code}, stdout {run.stdout.strip()[:200]!r} (expected {EXPECTED!r}), stderr "
            f"{run.stderr.strip()[-500:]!r}")
