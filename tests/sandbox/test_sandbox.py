"""The sandbox's keys (`rollout.sandbox.*`) each change what an execution may do; where isolation
is impossible it refuses instead of running the program; `run_tests` and `tandem sandbox run`."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.errors import SandboxUnavailable
from tandem.sandbox import SandboxPool, StdioTest, cgroups, execution, run, run_tests
from tandem.sandbox.availability import require
from tests.sandbox.conftest import ROOT, UID_BASE, bwrap_missing, limits, our_cgroups, sandbox_processes

pytestmark = pytest.mark.skipif(bwrap_missing() is not None, reason=str(bwrap_missing()))


def test_workers_run_at_once_each_as_its_slots_uid():
    """Two 1.5 s sleeps: side by side with workers=2, one after the other with workers=1; the
    slots' uids are uid_base and uid_base + 1 (as root)."""
    program = "import os, time\ntime.sleep(1.5)\nprint(os.getuid())\n"
    took = {}
    for workers in (1, 2):
        with SandboxPool(limits(workers=workers, wall_s=20.0)) as pool:
            started = time.monotonic()
            results = pool.map([(program, None), (program, None)])
            took[workers] = time.monotonic() - started
        assert [r.status for r in results] == ["ok", "ok"], results
        if os.geteuid() == 0:
            assert {int(r.stdout) for r in results} == set(range(UID_BASE, UID_BASE + workers))
    assert took[1] >= 3.0 and took[2] < 2.9, took


def test_memory_mb_bounds_an_allocation():
    program = "block = bytearray(100 * 2**20)\nprint(len(block))\n"
    assert run(program, None, limits(memory_mb=256)).stdout == f"{100 * 2**20}\n"
    small = run(program, None, limits(memory_mb=64))
    assert (small.status, small.reason) == ("memory", "memory limit rollout.sandbox.memory_mb=64 MiB reached")


def test_threads_count_as_processes_and_fit_in_memory_mb():
    """Threads stop at `processes` (the main thread is one), not earlier at RLIMIT_AS: glibc's
    per-thread malloc arenas (64 MiB of address space each) are held to 2 in the sandbox."""
    program = ("import threading, time\nstarted = []\ntry:\n    while True:\n"
               "        t = threading.Thread(target=time.sleep, args=(2,))\n        t.start()\n        started.append(t)\n"
               "except RuntimeError:\n    print(len(started))\n")
    for processes in (8, 16):
        result = run(program, None, limits(processes=processes, memory_mb=256))
        assert result.status == "ok" and int(result.stdout) == processes - 1, result


def test_file_bytes_bounds_a_written_file_and_the_program():
    program = ("import os\nwith open('big', 'wb') as f:\n    f.write(b'x' * 4096)\n    f.flush()\n"
               "print(os.path.getsize('big'))\n")
    assert run(program, None, limits(file_bytes=8192)).stdout == "4096\n"
    small = run(program, None, limits(file_bytes=1024))
    assert small.status == "error" and "File too large" in small.stderr, small
    refused = run("print(1)  " + "#" * 2000, None, limits(file_bytes=1024))
    assert refused.status == "refused" and "rollout.sandbox.file_bytes=1024" in refused.reason
    assert run("print(1)", b"x" * 2000, limits(file_bytes=1024)).status == "refused"


def test_stdin_reaches_the_program_and_output_bytes_cuts_stderr_too():
    result = run("import sys\nprint(sys.stdin.read().upper())\n", b"hello", limits())
    assert (result.status, result.stdout) == ("ok", "HELLO\n")
    loud = run("import sys\nsys.stderr.write('e' * 10000)\n", None, limits(output_bytes=100))
    assert (loud.status, loud.stderr) == ("output", "e" * 100)


def test_a_missing_bwrap_is_refused_and_the_program_never_runs(tmp_path):
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w').write('ran')\n"
    config = limits(bwrap=str(tmp_path / "no-such-bwrap"))
    with pytest.raises(SandboxUnavailable, match=r"rollout\.sandbox\.bwrap: bubblewrap .* was not found; install"):
        run(program, None, config)
    with pytest.raises(SandboxUnavailable):
        SandboxPool(config)
    assert not marker.exists()


def test_a_bwrap_that_fails_its_self_test_is_refused():
    """A stand-in that exits 0 without isolating anything: the self-test sees no namespace. It
    lies in a folder of /tmp of its own (tmp_path's parents are private to root), so that the
    slot's uid may run it."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-fake-bwrap-"))
    try:
        folder.chmod(0o755)
        fake = folder / "bwrap"
        fake.write_text("#!/bin/sh\necho 'not isolated'\n")
        fake.chmod(0o755)
        with pytest.raises(SandboxUnavailable, match=r"self-test failed.*'not isolated'"):
            require(limits(bwrap=str(fake)))
        with pytest.raises(SandboxUnavailable, match="self-test failed"):  # the cached answer
            run("print(1)", None, limits(bwrap=str(fake)))
    finally:
        shutil.rmtree(folder)


def test_the_wall_limit_counts_from_the_programs_start(monkeypatch):
    """A sandbox that takes 2 s to start the program (a bwrap behind a 2 s sleep; a host busy making
    and destroying network namespaces once took 13 s, and a trivial program timed out at a 3 s
    wall limit) leaves a 1 s wall limit to the program; a start past SETUP_S is a timeout that
    says so."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-slow-bwrap-"))
    try:
        folder.chmod(0o755)  # the slot's uid runs the stand-in
        slow = folder / "bwrap"
        slow.write_text(f"#!/bin/sh\nsleep 2\nexec {shutil.which('bwrap')} \"$@\"\n")
        slow.chmod(0o755)
        result = run("print(42)", None, limits(bwrap=str(slow), wall_s=1.0))
        assert (result.status, result.stdout) == ("ok", "42\n"), result
        assert result.seconds >= 2.0
        assert result.program_seconds is not None and result.program_seconds < 1.0, result  # the start's 2 s are not its
        monkeypatch.setattr(execution, "SETUP_S", 1.0)
        late = run("print(42)", None, limits(bwrap=str(slow), wall_s=5.0))
        assert (late.status, late.reason) == ("timeout", "the sandbox did not start the program within 1 s "
                                                         "(an overloaded host)"), late
        assert late.program_seconds is None, late
    finally:
        shutil.rmtree(folder)


def test_bwraps_report_read_in_pieces_still_gives_the_programs_pid():
    """bwrap writes its --info-fd report in pieces (the pid, then the namespaces' ids, then the
    closing brace) and closes the fd. Read part way, the pid must already be known: taking a
    partial report for a finished one without a pid made a kill fall back to the outer bwrap's
    group, and the orphaned program stayed a zombie (a suite run at ea11d0c, without cgroups)."""
    r, w = os.pipe()
    try:
        tree = execution._Tree(None, r, 0)
        assert not tree.read_info() and tree.pid is None  # nothing yet
        os.write(w, b'{\n    "child-pid": 4242')
        assert not tree.read_info() and tree.pid == 4242  # a piece, and the pid in it
        os.write(w, b',\n    "net-namespace": 4026532211\n}\n')
        os.close(w)
        w = -1
        assert tree.read_info() and tree.pid == 4242  # the rest, then the end
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_run_tests_asserts_and_stdio_pairs():
    code = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    import sys\n    print(sum(map(int, sys.stdin.read().split())))\n"
    report = run_tests(code, ["assert add(1, 2) == 3", "assert add(1, 2) == 4", StdioTest("2 3\n", "5\n"),
                              {"input": "2 3", "output": "6"}], config=limits())
    outcomes = report.outcomes
    assert [o.passed for o in outcomes] == [True, False, True, False]
    assert (report.passed, report.total, report.fraction, report.all_passed) == (2, 4, 0.5, False)
    assert outcomes[1].execution.status == "error" and "AssertionError" in outcomes[1].execution.stderr


def test_run_tests_is_not_fooled_by_an_early_exit_with_status_0():
    for escape in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        outcomes = run_tests("def f():\n    return 1\n" + escape, ["assert f() == 2"], config=limits()).outcomes
        assert outcomes[0].execution.status == "ok" and not outcomes[0].passed


def test_cli_prints_one_json_object(tmp_path, capsys):
    program = tmp_path / "upper.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\n")
    (tmp_path / "in.txt").write_text("hi")
    assert main(["sandbox", "run", str(program), "--stdin", str(tmp_path / "in.txt")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"status", "exit_code", "stdout", "stderr", "reason", "seconds"}
    assert (out["status"], out["exit_code"], out["stdout"], out["reason"]) == ("ok", 0, "HI\n", None)

    program.write_text("import time\ntime.sleep(30)\n")
    assert main(["sandbox", "run", str(program), "--timeout", "1"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert (out["status"], out["reason"]) == ("timeout", "wall-clock limit rollout.sandbox.wall_s=1.0 s reached")

    program.write_text("x = bytearray(200 * 2**20)\n")
    assert main(["sandbox", "run", str(program), "--memory-mb", "64"]) == 1
    assert json.loads(capsys.readouterr().out)["status"] == "memory"

    assert main(["sandbox", "run", str(tmp_path / "missing.py")]) == 2
    assert "missing.py: no such file" in capsys.readouterr().err
    assert main(["sandbox", "run", str(program), "--memory-mb", "1"]) == 2
    assert "rollout.sandbox.memory_mb" in capsys.readouterr().err


def test_without_cgroups_the_namespace_alone_leaves_nothing(monkeypatch):
    """Where there are no cgroups (and, not root, no sweep of the slot's uid), the program's death
    as its namespace's init must take its tree with it, and no zombie may be left for the host's
    pid 1 (a container's pid 1 may never reap it): a killed sleeper, a killed writer, a daemon."""
    monkeypatch.setattr(cgroups, "available", lambda: False)
    monkeypatch.setattr(execution, "uid_processes", lambda uid: [])
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(60)\n    os._exit(0)\ntime.sleep(0.2)\n")
    for program, status in [("import time\ntime.sleep(60)\n", "timeout"),
                             ("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n", "output"),
                             (daemon, "ok")]:
        result = run(program, None, limits(wall_s=2.0))
        assert result.status == status and result.cpu_seconds is None, result
        assert not sandbox_processes(range(UID_BASE, UID_BASE + 1)), program  # zombies included


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="starts the sandbox as nobody with setpriv (root)")
def test_without_root_it_runs_in_user_namespaces_as_the_user():
    """Started by an unprivileged user (nobody, with the system's Python and Tandem on PYTHONPATH):
    no setpriv, no cgroups, the user's own uid; still pid 1 of its namespaces, no network, the
    limits hold and nothing is left."""
    script = textwrap.dedent("""
        import json
        from tandem.sandbox import SandboxConfig, run
        probe = run("import os, socket\\nprint(os.getuid(), os.getpid(), [n for _, n in socket.if_nameindex()])")
        slow = run("import time\\ntime.sleep(30)", None, SandboxConfig(wall_s=1.0))
        bomb = run("import os\\nwhile True:\\n    os.fork()", None, SandboxConfig(wall_s=5.0))
        print(json.dumps([probe.to_json(), slow.to_json(), bomb.to_json()]))
    """)
    proc = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "/usr/bin/python3", "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": "/nonexistent"}, cwd="/")
    if proc.returncode != 0 and "No module named 'tandem'" in proc.stderr:
        pytest.skip(f"nobody cannot read the checkout at {ROOT}")
    assert proc.returncode == 0, proc.stderr
    probe, slow, bomb = json.loads(proc.stdout)
    assert probe["status"] == "ok" and probe["stdout"] == f"{NOBODY} 1 ['lo']\n", probe
    assert (slow["status"], slow["reason"]) == ("timeout", "wall-clock limit rollout.sandbox.wall_s=1.0 s reached")
    assert bomb["status"] == "error" and "BlockingIOError" in bomb["stderr"], bomb
    left = [p for p in sandbox_processes(range(NOBODY, NOBODY + 1)) if "/tmp/main.py" in p[2]]
    assert not left, left


def test_a_killed_parent_takes_its_sandboxes_with_it(tmp_path, monkeypatch):
    """A process running an execution is killed (SIGKILL: no cleanup of its own): the sandbox dies
    with it (setpriv --pdeathsig, bwrap --die-with-parent), and the next process that uses the
    sandbox removes the dead one's cgroups."""
    uid = UID_BASE + 7
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from tandem.sandbox import SandboxConfig, run
        print("running", flush=True)
        run("import time\\nprint('started', flush=True)\\ntime.sleep(60)", None,
            SandboxConfig(wall_s=100.0, uid_base={uid}))
    """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "running\n"
        deadline = time.monotonic() + 30
        while not [p for p in sandbox_processes(range(uid, uid + 1)) if "main.py" in p[2]]:
            assert time.monotonic() < deadline, "the sandbox never started"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while living := [p for p in sandbox_processes(range(uid, uid + 1)) if not _zombie(p[0])]:
        assert time.monotonic() < deadline, f"the sandbox outlived its parent: {living}"
        time.sleep(0.05)
    if cgroups.available():
        stale = glob.glob(f"/sys/fs/cgroup/*/tandem-sandbox/{parent.pid}-*")
        assert stale  # left by the killed parent, until a process sweeps them
        monkeypatch.setattr(cgroups, "_swept", False)  # this process swept once already
        cgroups.remove_stale()
        assert not glob.glob(f"/sys/fs/cgroup/*/tandem-sandbox/{parent.pid}-*")


def _zombie(pid: int) -> bool:
    """A dead process whose parent (the host's pid 1, after its own parent died) has not reaped it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_nothing_is_left_after_these_tests():
    assert not sandbox_processes(range(UID_BASE, UID_BASE + 2))
    if cgroups.available():
        assert not our_cgroups()


def test_a_tree_at_its_memory_limit_stopped_by_the_wall_clock_reports_memory():
    """The kernel may keep a tree at its memory cgroup's limit in reclaim past the wall limit: the
    OOM killer's record in the group decides the status (seen once on a loaded machine)."""
    from tandem.sandbox.execution import _classify

    class Group:  # what the execution reads of its cgroups
        def __init__(self, oom: bool):
            self.oom = oom

        def memory_hit(self) -> bool:
            return self.oom

        def pids_hit(self) -> bool:
            return False

    config = limits()
    assert _classify(config, "wall", None, b"", Group(True))[0] == "memory"
    assert _classify(config, "wall", None, b"", Group(True))[1].endswith(f"wall_s={config.wall_s} s reached")
    assert _classify(config, "wall", None, b"", Group(False)) == (
        "timeout", f"wall-clock limit rollout.sandbox.wall_s={config.wall_s} s reached")
    assert _classify(config, "wall", None, b"", None)[0] == "timeout"
