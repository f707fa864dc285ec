"""Steer: when a detector's signal becomes an advisory note for the model, and the note texts.

Rules (seed 003 "Steer"; ``reference/in-session-supervisor-mechanics.md`` section 2, "When a signal steers"):

- a note is considered only for the signals of the latest round;
- the self-report excuses: ``done``, ``blocked`` and ``need_input`` get no note, and ``no_progress`` gets none while
  the agent reports ``exploring``; with no report, every signal may steer;
- the highest-priority signal that is not excused is the one noted;
- **doubling back-off**: the first firing of a signal gets a note; while the same signal keeps firing (the note
  was ignored), the note is re-sent at its 2nd, 4th, 8th, 16th... consecutive firing (gaps 1, 2, 4, 8 rounds),
  never going silent and never growing costly. A different signal gets its note at once; a round where
  nothing fires and a genuine user turn start afresh. (Octomind counts a repeat only when the agent re-issues
  the same call set; here any continued firing counts as ignoring the note, which also bounds the notes for an
  agent that varies its calls without making progress.)

Notes are advisory: fixed texts, wrapped in ``<supervisor-note signal="...">`` so the model can tell them from
the user (the self-report instruction says so). They never block a tool call or rewrite the agent's messages.
"""

from __future__ import annotations

from .detectors import ALTERNATION, LOOP, MONOLOGUE, NO_PROGRESS, RECOVERY, SIGNALS

SILENT_STATES = frozenset({"done", "blocked", "need_input"})

_ADVISORY = ("This may be intentional (polling, expected probes): judge from the actual outputs and the user's "
             "task. This note is advisory and does not ask for extra work.")

NOTES: dict[str, str] = {
    LOOP: "Your last three tool rounds repeated the same calls and got the same results. If you are waiting on a "
          "background job, wait longer between checks or report back with its status; otherwise try a different "
          "approach, or report that you are blocked.",
    ALTERNATION: "Your last six tool rounds alternated between the same two actions with the same results. Step "
                 "back: decide what would change the outcome, try a different approach, or report that you are "
                 "blocked.",
    MONOLOGUE: "Your last three turns ended without a tool call and said the same thing, and nothing changed. If "
               "the task needs an action, take it with a tool call; if you are finished or blocked, say so once in "
               "your status line.",
    NO_PROGRESS: "Your last five tool rounds produced no new results and no successful change. Re-read the task, "
                 "choose a step that yields new information or makes a change, or report that you are blocked.",
    RECOVERY: "A command you ran keeps failing and has not succeeded since. Read its error and change the cause "
              "before running it again, or report that you are blocked. Honour every execution restriction of the "
              "user.",
}


def note(signal: str, body: str) -> str:
    """``body`` (already XML-escaped) as a supervisor note for ``signal``: the one wrapper every note uses."""
    return f'<supervisor-note signal="{signal}">{body}</supervisor-note>'


def note_text(signal: str) -> str:
    """The fixed, byte-stable note for ``signal`` (one of ``SIGNALS``)."""
    return note(signal, f"{NOTES[signal]} {_ADVISORY}")


def excused(signal: str, state: str | None) -> bool:
    """Whether the self-reported ``state`` (None: no report) excuses ``signal``."""
    return state in SILENT_STATES or (signal == NO_PROGRESS and state == "exploring")


class SteerPolicy:
    """Decides, once per request whose history completed new rounds, which signal (if any) gets a note.

    Sans-IO: the caller passes the latest round's signals and the agent's latest self-reported state.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self.firings = 0  # consecutive firings of ``signal`` since its first note

    def reset(self) -> None:
        """Start afresh (a genuine user turn)."""
        self.signal, self.firings = None, 0

    def decide(self, signals: tuple[str, ...], state: str | None) -> str | None:
        """The signal to note now, or None. ``signals`` are those of the latest round (any order)."""
        if not signals:
            self.reset()
            return None
        candidates = [s for s in SIGNALS if s in signals and not excused(s, state)]
        if not candidates:
            return None
        signal = candidates[0]
        if signal != self.signal:
            self.signal, self.firings = signal, 1
            return signal
        self.firings += 1
        return signal if self.firings & (self.firings - 1) == 0 else None
