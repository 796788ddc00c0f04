"""What `opsd` prints for people: the step line's columns, the line about the step in progress, `--help`."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from opsd.cli import app
from opsd.config import RunConfig
from opsd.progress import StepProgress, format_line, format_step, in_step_line

DISAGREE = "teacher_verifier/all/pairwise_disagreement"


def test_disagree_keeps_its_place_on_a_step_without_a_mixed_group():
    """A step whose groups each have one reward has no disagreement value: "-" in its column, not a gap."""
    teacher_step = {"step": 4, "success_rate": 0.0, "teacher_student_gap": -0.5, "loss": 0.01,
                    "teacher_verifier/all/groups": 0.0}
    mixed = format_step({**teacher_step, DISAGREE: 0.25, "teacher_verifier/all/groups": 1.0}).split("  ")
    flat = format_step(teacher_step).split("  ")
    assert mixed == ["step 4", "success 0.00", "gap -0.500", "disagree 0.25", "loss +0.0100"]
    assert flat == ["step 4", "success 0.00", "gap -0.500", "disagree -", "loss +0.0100"]
    assert format_step({**teacher_step, DISAGREE: None}).split("  ") == flat  # a null in metrics.jsonl
    # Without a teacher there is nothing to disagree with: no column at all, on every step.
    assert format_step({"step": 4, "success_rate": 0.0, "loss": 0.01}) == "step 4  success 0.00  loss +0.0100"


def test_a_record_that_is_not_numbers_is_a_step_line_with_question_marks():
    """`opsd run` prints each metrics.jsonl line as it supervises the roles: a damaged or hand-edited line
    (a string or a list for a number, an int past float range, no step, a count missing, not JSON at all) is
    shown as such, never an exception that ends the run."""
    assert format_step({"step": 2, "success_rate": "0.5", "loss": [1], "reward_mean": 10**400, "valid": True}) \
        == "step 2  success ?  reward ?  loss ?"
    assert format_step({"success_rate": 1.0, "format_valid_rate": False}) == "step ?  success 1.00  valid ?"
    assert format_step({"step": "[red]3", "privileged_signal": 0.5, "hint_match_turns": 2}) == "step ?  priv +0.500 (2/?)"
    assert format_line('{"step": 1, "loss": 0.5}\n') == "step 1  loss +0.5000"
    for line in ("not json", "[1, 2]", "null", "[" * 100_000, '{"step": 1, "loss": 0.'):
        assert format_line(line).startswith("(a metrics.jsonl line that is not a JSON object: ")
    assert len(format_line("x" * 10_000)) < 200 and "\x1b" not in format_line("\x1b[2J")


def _progress(terminal: bool) -> StepProgress:
    # No Redis is reached: `news` takes the counts poll() would read.
    cfg = RunConfig.model_validate({"run": {"method": "opd"}, "env": {"num_games": 2}})
    return StepProgress("redis://:pw@127.0.0.1:1/0", cfg, terminal=terminal)


def test_a_plain_in_step_line_never_follows_a_step_line_at_once():
    """To a file: at most one line every PLAIN_EVERY_S (30 s), the clock restarting at each new step, so a
    step line is not followed by a line announcing the next step with zero counts; with nothing new, still
    one line every HEARTBEAT_S (60 s), and the step's groups all in says the trainer is training."""
    p = _progress(terminal=False)
    assert p.news(0, 0, 0, now=100.0) is None  # the run's first look
    assert p.news(0, 1, 0, now=110.0) is None  # too soon
    assert p.news(0, 2, 1, now=131.0) == "2/2 rolled out, 1/2 scored; 31 s into the step"
    assert p.news(0, 2, 1, now=170.0) is None  # nothing new, and under a minute
    assert p.news(0, 2, 2, now=172.0) == "2/2 rolled out, 2/2 scored; training; 72 s into the step"
    assert p.news(0, 2, 2, now=231.0) is None  # nothing new
    assert p.news(0, 2, 2, now=232.0) == "2/2 rolled out, 2/2 scored; training; 132 s into the step"
    assert p.news(1, 2, 2, now=240.0) is None  # step 0's line was just printed
    assert p.news(1, 3, 2, now=259.0) is None  # 19 s after it
    assert p.news(1, 3, 2, now=271.0) == "1/2 rolled out, 0/2 scored; 31 s into the step"


def test_on_a_terminal_every_change_and_each_new_step_is_shown():
    p = _progress(terminal=True)
    assert p.news(0, 5, 5, now=0.0) == "0/2 rolled out, 0/2 scored"
    assert p.news(0, 6, 5, now=0.5) == "1/2 rolled out, 0/2 scored"
    assert p.news(0, 6, 5, now=1.0) is None
    assert p.news(0, 7, 7, now=1.2) == "2/2 rolled out, 2/2 scored; training"
    # The next step starts from zero again, shown even though the text is one the bar showed before.
    assert p.news(1, 6, 5, now=1.5) == "0/2 rolled out, 0/2 scored"


def test_without_a_teacher_only_rollouts_are_counted():
    cfg = RunConfig.model_validate({"run": {"method": "grpo"}, "env": {"num_games": 2}})
    p = StepProgress("redis://:pw@127.0.0.1:1/0", cfg, terminal=True)
    assert p.news(0, 0, 0, now=0.0) == "0/2 rolled out"  # the step's counts start here
    assert p.news(0, 1, 0, now=0.5) == "1/2 rolled out"
    assert p.news(0, 2, 0, now=1.0) == "2/2 rolled out; training"


def test_the_in_step_line_names_the_step_in_progress_and_none_past_the_last():
    news = "1/2 rolled out, 0/2 scored"
    # Step lines are "step 0" .. "step 2" for 3 steps: after 2 of them, step 2 is the one in progress.
    assert in_step_line(0, 3, news) == f"step 0: {news}"
    assert in_step_line(2, 3, news) == f"step 2: {news}"
    assert in_step_line(3, 3, news) is None  # the last step's line is out: the trainer is saving
    assert in_step_line(4, 3, news) is None
    assert in_step_line(1, 3, None) is None


def test_the_progress_bar_fits_an_80_column_terminal():
    """The bar `opsd run` shows, on the quickstart's longest in-step text: nothing is cut off in 80 columns
    (it ended at "...0 scored since the la..." before)."""
    import io

    from rich.console import Console

    from opsd.progress import progress_bar

    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    text = in_step_line(1, 3, "2/2 rolled out, 2/2 scored; training")
    with progress_bar(console) as progress:
        progress.add_task(text, total=3, completed=1)
        console.print(progress.make_tasks_table(progress.tasks))
    shown = console.file.getvalue()
    assert text in shown and "1/3 steps" in shown and "…" not in shown, shown
    assert max(len(line) for line in shown.splitlines()) <= 80


def _groups(group, path: tuple[str, ...] = ()):
    """(words, group) for `group` and every command group under it (typer's own click classes: duck-typed)."""
    yield path, group
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _groups(cmd, (*path, name))


def test_help_shows_each_commands_description_whole_at_80_columns():
    """`opsd --help` (and `opsd credit --help`) list each command with its whole first paragraph, one
    sentence on one line: click cut longer ones to "..." (issue 24)."""
    seen = []
    for path, group in _groups(typer.main.get_command(app)):
        out = CliRunner().invoke(app, [*path, "--help"], terminal_width=80).output
        listed = out[out.index("Commands:"):].splitlines()[1:]  # one line a command
        assert len(listed) == len(group.commands) and max(map(len, listed)) <= 80, out
        for name, cmd in group.commands.items():
            summary = " ".join(cmd.help.split("\n\n")[0].split())
            assert summary.endswith(".") and ". " not in summary, f"{name}: not one sentence: {summary!r}"
            assert [name, summary] in [line.split(None, 1) for line in listed], f"{name}: {summary!r} not whole in\n{out}"
            seen.append(" ".join((*path, name)))
    assert sorted(seen) == ["credit", "credit check", "eval", "inspect", "prepare", "run"]
