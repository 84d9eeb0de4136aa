"""Running untrusted code (a model's programs) isolated: bubblewrap namespaces, rlimits, cgroup v1
limits, the tree killed on any limit. See docs/security.md."""

from tandem.errors import SandboxUnavailable
from tandem.sandbox.checks import StdioTest, TestOutcome, TestReport, run_tests
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import STATUSES, Deadline, Execution
from tandem.sandbox.pool import SandboxPool, run
from tandem.sandbox.session import Sandbox, process_pool

__all__ = ["STATUSES", "Deadline", "Execution", "Sandbox", "SandboxConfig", "SandboxPool", "SandboxUnavailable",
           "StdioTest", "TestOutcome", "TestReport", "process_pool", "run", "run_tests"]
