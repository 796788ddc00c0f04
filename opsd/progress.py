"""What `opsd run` prints while a run trains: one line per finished step (a metrics.jsonl record, `format_step`)
and news from inside the step in progress (`StepProgress`, `in_step_line`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.markup import escape

from opsd.config import RunConfig

# (metrics key, label, format, key whose presence makes a missing value a "-"): a column of a teacher
# run stays in place on steps where it has nothing to say (no gold-action turns for priv, no group with two
# distinct rewards for disagree), so the step lines line up.
STEP_COLUMNS = (
    ("success_rate", "success", "{:.2f}", None),
    ("format_valid_rate", "valid", "{:.2f}", None),
    ("reward_mean", "reward", "{:.2f}", None),
    ("teacher_student_gap", "gap", "{:+.3f}", None),
    ("privileged_signal", "priv", "{:+.3f}", "hint_match_turns"),
    ("teacher_verifier/all/pairwise_disagreement", "disagree", "{:.2f}", "teacher_student_gap"),
    ("mean_span_length", "span", "{:.1f}", None),
    ("loss", "loss", "{:+.4f}", None),
    ("kl", "kl", "{:.2e}", None),  # the KL to the reference: only with trainer.kl_coef > 0
    ("rollout_seconds", "rollout_s", "{:.0f}", None),
    ("teacher_seconds", "teacher_s", "{:.0f}", None),
    ("train_seconds", "train_s", "{:.0f}", None),
    ("step_seconds", "step_s", "{:.0f}", None),
)


def complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of a file another process appends to (a half-written last line is left out)."""
    if not path.exists():
        return []
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def _cell(value: object, fmt: str) -> str:
    """`value` formatted with `fmt`; "?" for what is not a number (a string, a list, a bool, an int past float
    range): the step line shows it was odd instead of ending the run that prints it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "?"
    try:
        return fmt.format(value)
    except (OverflowError, ValueError):
        return "?"


def format_step(record: dict) -> str:
    """One human line for a metrics.jsonl record (a missing step or count, or a value that is not a number,
    shows as "?")."""
    parts = [f"step {_cell(record.get('step'), '{}')}"]
    for key, label, fmt, dash_with in STEP_COLUMNS:
        if record.get(key) is not None:
            parts.append(f"{label} {_cell(record[key], fmt)}")
        elif dash_with is not None and record.get(dash_with) is not None:
            parts.append(f"{label} -")
        if key == "privileged_signal" and record.get("hint_match_turns") is not None:
            # What the figure rests on: turns that took the hint's action / turns that did not.
            parts[-1] += f" ({_cell(record['hint_match_turns'], '{}')}/{_cell(record.get('hint_other_turns'), '{}')})"
    return "  ".join(parts)


def format_line(line: str) -> str:
    """format_step of one metrics.jsonl line; a line that is not a JSON object is named as such (a damaged or
    hand-edited file), never an exception in the loop that supervises the run."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        record = None
    if not isinstance(record, dict):
        return f"(a metrics.jsonl line that is not a JSON object: {printable_line(line, 80)})"
    return format_step(record)


def printable_line(text: str, limit: int = 300) -> str:
    """Text from a file (a vector file's method, case, error; a file name) as one safe terminal line: control
    characters (ESC, a newline, a bidi override) and lone surrogates as their escapes, at most `limit` characters,
    rich markup escaped. Printed raw, a file could clear the screen, or stop the report with a traceback
    (a surrogate cannot be written to stdout)."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    if len(flat) > limit or len(text) > limit:
        flat = flat[:limit] + f"... ({len(text)} characters)"
    return escape(flat)


class StepProgress:
    """What happens inside a step, from the run's counts in Redis (`StreamNames.counts`: groups each stream got):
    groups rolled out and, with a teacher, scored, since the last step line (with max_staleness > 0 some belong
    to the next steps). `poll(step)` returns a short text when there is something new to say (`news`)."""

    PLAIN_EVERY_S = 30.0
    HEARTBEAT_S = 60.0  # not a terminal, nothing new: still a line this often, so a long update is not silence

    RETRY_AFTER_S = 10.0  # after a failed read: the display waits, the supervisor loop must not

    def __init__(self, redis_url: str, cfg: RunConfig, terminal: bool):
        from opsd.queue import StreamNames

        self.url, self.terminal = redis_url, terminal
        self.quiet_until = 0.0
        self.names = StreamNames(cfg.redis.stream_prefix)
        self.teacher = cfg.needs_teacher
        self.per_step = cfg.env.num_games
        self.client = None
        self.step: int | None = None
        self.base = (0, 0)
        self.last_text, self.last_print = "", time.monotonic()
        self.step_start = self.last_print

    def _counts(self) -> tuple[int, int]:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if self.client is None:  # its own client: short timeouts, no retries (the loop also supervises the roles)
            self.client = redis.Redis.from_url(self.url, protocol=2, socket_timeout=0.5, socket_connect_timeout=0.5,
                                               retry=Retry(NoBackoff(), 0))
        raw = self.client.hgetall(self.names.counts)
        return tuple(int(raw.get(f"produced:{stream}".encode(), 0)) for stream in (self.names.rollouts, self.names.scored))

    def poll(self, step: int) -> str | None:
        """`news` about `step` from the counts in Redis now (None also when Redis does not answer)."""
        if time.monotonic() < self.quiet_until:
            return None
        try:
            rolled, scored = self._counts()
        except Exception:  # a Redis hiccup: the roles ride it out, and so does this display
            self.quiet_until = time.monotonic() + self.RETRY_AFTER_S
            return None
        return self.news(step, rolled, scored, time.monotonic())

    def news(self, step: int, rolled: int, scored: int, now: float) -> str | None:
        """The text for `step` given the run's totals `rolled` and `scored` at monotonic time `now`, or None.

        The counts are groups since the last step line, out of the groups a step trains on (`env.num_games`);
        with max_staleness > 0 some may belong to the next steps. Once the step's groups are all in (scored, or
        rolled out without a teacher) the text says the trainer is training. On a terminal every change is news
        (the progress bar's live description); otherwise a plain line, with the seconds since the last step
        line, comes at most every PLAIN_EVERY_S seconds, counted from the last line, a step line included (the
        step line just said what there was to say, so a new step is not announced with zero counts), and at
        least every HEARTBEAT_S."""
        if step != self.step:  # counts start again; a terminal shows the new step at once even if the text repeats
            self.step, self.base, self.last_print, self.last_text = step, (rolled, scored), now, ""
            self.step_start = now
        new_rolled, new_scored = rolled - self.base[0], scored - self.base[1]
        # Short enough for an 80-column terminal beside the bar (`progress_bar`): "2/2 rolled out, 1/2 scored".
        text = f"{new_rolled}/{self.per_step} rolled out"
        text += f", {new_scored}/{self.per_step} scored" if self.teacher else ""
        text += "; training" if (new_scored if self.teacher else new_rolled) >= self.per_step else ""
        quiet = now - self.last_print
        if self.terminal:
            skip = text == self.last_text
        else:
            skip = quiet < self.PLAIN_EVERY_S or (text == self.last_text and quiet < self.HEARTBEAT_S)
        if skip:
            return None
        self.last_text, self.last_print = text, now
        return text if self.terminal else f"{text}; {now - self.step_start:.0f} s into the step"


def in_step_line(done: int, total: int, news: str | None) -> str | None:
    """The line about the step in progress after `done` of `total` steps, or None: no news, or every step
    done (the trainer is saving: no step is in progress). Steps are numbered from 0, as the step lines
    and metrics.jsonl number them, so the step in progress is step `done` (< `total`)."""
    if news is None or done >= total:
        return None
    return f"step {done}: {news}"


# The bar's width: with it, the step-in-progress text of a quickstart-sized run ("step 1: 2/2 rolled out, 2/2
# scored; training"), the step count and the time fit an 80-column terminal.
BAR_WIDTH = 12


def progress_bar(console, disable: bool = False):
    """The progress display `opsd run` shows on a terminal: the step in progress (`in_step_line`), a bar, the
    steps done and the time elapsed."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(bar_width=BAR_WIDTH),
                    TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(), console=console,
                    disable=disable)
