"""Reading the second wave of a fill in the first wave's pass, behind every answer the first may give.

A fill decides its first field alone, then asks every other field after that field's real answer
line (``Schema.waves``): two passes, the second short. On a CPU a short pass costs mostly what any
pass costs (the weights read, the kernels set up), not its few tokens: a session's append spent 195
ms on a second pass of 27 tokens against 280 ms on a first of 57 (SmolLM2-135M, torch, one thread).
When the first field has few answers, the first pass can read the second wave's rows behind each of
its answer lines, as rows of the same packed tree; once the first field's answer is chosen (after
debiasing, calibration or a trained head, as always), the branch under that answer is the second
wave, read after exactly the tokens it would have been read after. The answers are the same (the
same positions over the same keys; the packed tree's mask keeps each branch from seeing another),
and one pass is saved for the branches not taken.

It pays only while the branches not taken are short, so it is used when they add at most
``SPECULATIVE_TOKENS`` row tokens, on a backend whose rows share the prefix (``row_layout ==
"packed"``: a backend of copies would read every row with its whole prefix). ``filling.read_waves``
takes the chosen branch; ``tests/test_speculation.py`` checks the answers against two-pass reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from pcd_core.reading.readout import Readout
from pcd_core.reading.rounds import DecisionTask

#: the most row tokens the branches not taken may add to the first pass: about what a CPU pass's
#: fixed part costs (the 27-token second pass above took as long as some 60 tokens more in a first)
SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class Speculation:
    """The second wave's decisions behind each answer line of the first wave's field.

    ``leads`` holds one answer line per label of the first field, in label order; the first pass's
    tasks are the first wave's, then ``n_wave`` tasks per branch, branch by branch.
    """

    leads: tuple[tuple[int, ...], ...]
    n_first: int
    n_wave: int

    def tasks(self, first: list[DecisionTask], wave: list[DecisionTask]) -> list[DecisionTask]:
        """The first wave's tasks, then the second wave's behind each lead."""
        assert len(first) == self.n_first and len(wave) == self.n_wave
        behind = [
            DecisionTask(task.trie, task.strategy, task.branch_norm, lead=lead + task.lead)  # reads of its own
            for lead in self.leads
            for task in wave
        ]
        return [*first, *behind]

    def first(self, readouts: list[Readout]) -> list[Readout]:
        """The first wave's readouts among a speculative pass's."""
        return readouts[: self.n_first]

    def branch(self, readouts: list[Readout], label: int) -> list[Readout]:
        """The second wave's readouts behind the answer ``label`` (an index into ``leads``)."""
        start = self.n_first + label * self.n_wave
        return readouts[start : start + self.n_wave]


def speculate(
    leads: tuple[tuple[int, ...], ...], wave_lines: list[tuple[tuple[int, ...], ...]], n_first: int, packed: bool
) -> Speculation | None:
    """A ``Speculation`` when it pays: a packed backend, and the branches not taken adding at most
    ``SPECULATIVE_TOKENS`` row tokens. ``leads`` are the first field's answer lines; ``wave_lines``
    each second-wave field's answer lines, whose longest bounds what its rows read in a branch.
    """
    if not packed or not wave_lines:
        return None
    per_branch = max(map(len, leads)) + sum(max(map(len, lines)) for lines in wave_lines)
    if (len(leads) - 1) * per_branch > SPECULATIVE_TOKENS:
        return None
    return Speculation(leads=leads, n_first=n_first, n_wave=len(wave_lines))
