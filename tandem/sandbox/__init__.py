"""Running untrusted code (a model's programs) isolated: bubblewrap namespaces, rlimits, cgroup v1
limits, the tree killed on any limit. See docs/security.md."""

from tandem.errors import SandboxUnavailable
from tandem.sandbox.checks import StdioTest, TestOutcome, run_tests
from tandem.sandbox.config import SandboxConfig
from tandem.sandbox.execution import STATUSES, Execution
from tandem.sandbox.pool import SandboxPool, run

__all__ = ["STATUSES", "Execution", "SandboxConfig", "SandboxPool", "SandboxUnavailable", "StdioTest",
           "TestOutcome", "run", "run_tests"]
