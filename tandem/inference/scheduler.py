"""Continuous batching: which sequences run in the next step, and preemption when blocks run out.

Each `schedule()` call is one model step: a prefill of the waiting sequences admitted in FIFO
order under `max_num_seqs`, `max_num_batched_tokens` and the free blocks, else one decode token
for every running sequence. A decode that finds no block preempts the most recently admitted
running sequence by recompute (back to the front of the waiting queue with its tokens). See
docs/inference.md, "Scheduling policy"."""

from __future__ import annotations

from collections import deque

from tandem.inference.block_manager import BlockManager
from tandem.inference.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample that already holds (shared) blocks."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """-> (sequences to run, is_prefill). Empty when nothing can run."""
        batch: list[Sequence] = []
        num_tokens = 0
        num_seqs = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            if num_seqs + seq.fork_n > self.max_num_seqs:
                break
            # The first prefill may exceed the budget alone, so a long prompt cannot stall the queue.
            if batch and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += len(seq) - seq.num_computed_tokens
            num_seqs += seq.fork_n
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.append(seq)
        if batch:
            return batch, True

        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:  # alone and still no block: it preempts itself
                    self.preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                batch.append(seq)
        self.running.extend(batch)
        return batch, False

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence from whichever queue holds it; free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
