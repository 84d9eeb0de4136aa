"""Disk transport: every rank joins `save_hf` into `meta.versioned_path()` (written under a
temporary name, renamed when complete) before generation pauses; then the servers load it, staged (unstaged on servers without staging,
with a tied model's output head written out where they need it).
After every server committed version N, older versions are deleted (N stays); after a failure,
N's directory is."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from tandem.fleet import ops
from tandem.models.tied_head import write_tied_output_head
from tandem.weights.calls import wait_for
from tandem.weights.meta import WeightUpdateMeta
from tandem.weights.report import Clock, UpdateReport, WeightSyncError, timed
from tandem.weights.transports.base import Transport
from tandem.weights.verify import UpdateVerifier

_VERSION_DIR = re.compile(r"^v(\d{8,})$")


class DiskTransport(Transport):
    def prepare(self, meta: WeightUpdateMeta, report: UpdateReport) -> None:
        with timed(report, "save"):
            saved = Path(self.source.save_hf(meta.versioned_path(), overwrite=True))
        report.bytes = sum(f.stat().st_size for f in saved.glob("*.safetensors"))

    def stage(self, meta: WeightUpdateMeta, clock: Clock, report: UpdateReport, failure: WeightSyncError | None,
              verifier: UpdateVerifier | None) -> WeightSyncError | None:
        if self.rank != 0 or failure is not None:
            return failure
        staged = self.fleet.capabilities.staged_commit
        adapter = meta.lora_alpha is not None  # a PEFT adapter directory (`WeightSource.save_hf`)
        if self.fleet.capabilities.tied_head_on_disk and not adapter:
            write_tied_output_head(meta.versioned_path())
        with timed(report, "load"):
            # Staged where the servers can (committed with the rest); else loaded now (SGLang, vLLM).
            request = ops.DiskLoad(str(meta.versioned_path()), commit=not staged, adapter=adapter)
            failure = wait_for(self.fleet.send(ops.LOAD_DISK, request), ops.LOAD_DISK.name, clock.left())
        if failure is None and verifier is not None:
            verifier.add_checkpoint(meta.versioned_path())
        return failure

    def committed(self, meta: WeightUpdateMeta) -> None:
        for path in Path(meta.path).iterdir():  # every server holds `version`: older copies can go
            m = _VERSION_DIR.match(path.name)
            if m and int(m.group(1)) < meta.version and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)

    def rollback(self, meta: WeightUpdateMeta) -> None:
        shutil.rmtree(meta.versioned_path(), ignore_errors=True)
