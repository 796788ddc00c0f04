"""reasoning-gym adapter (opsd/envs/reasoning_gym.py) on the real reasoning_gym package."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from opsd.config import EnvSection
from opsd.envs import EnvContext, Task, get_adapter
from opsd.skills import privileged_text

rg = get_adapter("reasoning_gym")
CTX = EnvContext()


def _cfg(datasets=("basic_arithmetic",), size=64, **common) -> EnvSection:
    return EnvSection(name="reasoning_gym", reasoning_gym={"datasets": list(datasets), "size": size}, **common)


def _play(task: Task, answer: str, cfg: EnvSection | None = None):
    env = rg.open_env(task, cfg or _cfg(), CTX)
    first = env.reset()
    return env, first, env.step(answer)


def test_interface_and_prompt():
    assert (rg.NAME, rg.ACTION_TAGS, rg.METRIC) == ("reasoning_gym", ("answer",), "success")
    obs, admissible, replies = rg.PROMPT.example
    assert admissible == [] and set(replies) == {"action", "think"} == set(rg.PROMPT.system)
    assert replies["action"] == "<answer>37</answer>"
    assert replies["think"].startswith("<think>") and replies["think"].endswith("<answer>37</answer>")
    assert "<answer></answer>" in rg.PROMPT.invalid_feedback
    assert "<think></think>" in rg.PROMPT.system["think"] and "<answer></answer>" in rg.PROMPT.system["action"]


def test_reference_answer_wins_and_step_after_done_raises():
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    answer = task.spec["answer"]
    assert task.category == task.skill_key == "basic_arithmetic"
    assert task.gold_path == [f"answer: {answer}"]
    env, first, step = _play(task, f"  {answer}\n")
    assert first.observation == task.spec["question"] and not first.done and first.policy_commands == [answer]
    assert (step.reward, step.won, step.done, step.lost, step.invalid_action) == (1.0, True, True, False, False)
    with pytest.raises(RuntimeError):
        env.step(answer)
    # reset() starts the episode again
    assert env.reset().observation == task.spec["question"]
    assert env.step("0").done


def test_wrong_answers_do_not_win():
    task = rg.make_tasks(_cfg(), CTX, "train")[1]
    answer = task.spec["answer"]
    wrong = str(int(answer) + 1)
    for text in (wrong, "", "🙂 ünïcode\x00 " * 50, "x" * 100_000):
        _, _, step = _play(task, text)
        assert (step.reward, step.won, step.done, step.invalid_action) == (0.0, False, True, False), text[:20]
    # the verifier's partial credit: the reference answer inside other text
    _, _, step = _play(task, f"The answer is {answer}")
    assert 0.0 < step.reward < 1.0 and not step.won and step.done


class _FakeVerifier:
    """Stands in for rg._VERIFIER (the verifier process) and returns canned replies."""

    def __init__(self, reply):
        self.reply, self.requests = reply, []

    def score(self, request, timeout_s):
        self.requests.append((json.loads(json.dumps(request)), timeout_s))  # plain JSON data only
        return dict(self.reply)


def test_step_before_reset_raises_and_verifier_error_scores_zero(monkeypatch):
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    env = rg.open_env(task, _cfg(), CTX)
    with pytest.raises(RuntimeError):
        env.step("1")
    env.reset()
    fake = _FakeVerifier({"error": "ZeroDivisionError: verifier bug"})
    monkeypatch.setattr(rg, "_VERIFIER", fake)
    step = env.step(task.spec["answer"])
    assert (step.reward, step.won, step.done) == (0.0, False, True)
    assert step.info["verifier_error"] == "ZeroDivisionError: verifier bug"
    (request, timeout_s), = fake.requests
    assert request["answer"] == task.spec["answer"] and request["dataset"] == "basic_arithmetic"
    assert timeout_s == 5.0
    env.close()
    env.close()
    # in the verifier process, a failing dataset build is an error reply, not an exception
    assert rg._verify({"dataset": "no_such", "seed": 1, "size": 1, "entry": {}, "answer": "1"})["error"].startswith(
        "ValueError: unknown reasoning-gym dataset")


def test_non_finite_verifier_scores_score_zero(monkeypatch):
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    for value in (float("inf"), float("-inf"), float("nan")):
        monkeypatch.setattr(rg, "_VERIFIER", _FakeVerifier({"score": value}))
        env = rg.open_env(task, _cfg(), CTX)
        env.reset()
        step = env.step("garbage")
        assert (step.reward, step.won, step.done) == (0.0, False, True), value
        assert step.info["verifier_error"] == f"non-finite score {value}"
    monkeypatch.setattr(rg, "_VERIFIER", _FakeVerifier({"score": 3.0}))  # finite: clamped
    env = rg.open_env(task, _cfg(), CTX)
    env.reset()
    assert env.step("x").reward == 1.0


def test_code_eval_datasets_refused_without_opt_in():
    for name in ("spiral_matrix", "countdown", "n_queens", "simple_integration"):
        with pytest.raises(ValueError, match=f"'{name}'.*allow_code_eval_verifiers"):
            rg.make_tasks(_cfg(datasets=(name,), size=4, game_pool=1, eval_pool=1), CTX, "train")
    # every listed dataset is also found by the source scan (the list is only a backstop)
    assert all("calls" in rg.code_eval_reason(name) for name in rg.CODE_EVAL_DATASETS)
    assert rg.code_eval_reason("basic_arithmetic") is None and rg.code_eval_reason("chain_sum") is None
    allowed = _cfg(datasets=("spiral_matrix",), size=4, game_pool=1, eval_pool=1,)
    allowed = allowed.model_copy(update={"reasoning_gym": allowed.reasoning_gym.model_copy(
        update={"allow_code_eval_verifiers": True})})
    (task,) = rg.make_tasks(allowed, CTX, "train")
    with pytest.raises(ValueError, match="allow_code_eval_verifiers"):  # a task from the wire, too
        rg.open_env(task, _cfg(), CTX)


def _code_eval_cfg(name: str, **rg_fields) -> EnvSection:
    return EnvSection(name="reasoning_gym", game_pool=1, eval_pool=1, reasoning_gym={
        "datasets": [name], "size": 4, "allow_code_eval_verifiers": True, **rg_fields})


def test_model_answer_never_runs_in_the_rollout_process(tmp_path):
    # spiral_matrix eval()s the answer, countdown sympy.parse_expr()s it: the code reaches only the
    # sandboxed verifier process, whose audit hook refuses writes and processes.
    for name in ("spiral_matrix", "countdown"):
        cfg = _code_eval_cfg(name)
        (task,) = rg.make_tasks(cfg, CTX, "train")
        task = Task.from_dict(json.loads(json.dumps(task.to_dict())))
        assert _play(task, task.spec["answer"], cfg)[2].won  # the reference answer still wins
        for attack in (f"__import__('pathlib').Path({str(tmp_path / 'write')!r}).write_text('x') and [1]",
                       f"__import__('os').system('touch {tmp_path / 'shell'}') or [1]",
                       f"__import__('subprocess').run(['touch', {str(tmp_path / 'sub')!r}]) and [1]"):
            step = _play(task, attack, cfg)[2]
            assert step.reward < 1.0 and not step.won and step.done  # countdown gives 0.01 to a bad formula
        assert list(tmp_path.iterdir()) == [], name


def test_verifier_timeout_and_crash_score_zero_and_recover():
    cfg = _code_eval_cfg("spiral_matrix", verifier_timeout_s=1.0)
    (task,) = rg.make_tasks(cfg, CTX, "train")
    assert _play(task, task.spec["answer"], cfg)[2].won  # the verifier process is up
    sleeper = rg._VERIFIER._proc  # the verifier process the next answer goes to
    # An answer that takes an hour: only the 1 s verifier timeout can end the step within the test. The
    # 60 s join is a hang guard (unbounded, the step waits for the answer and the thread stays alive).
    steps, hour = [], "__import__('time').sleep(3600) or [1]"
    player = threading.Thread(target=lambda: steps.append(_play(task, hour, cfg)[2]), daemon=True)
    player.start()
    player.join(60)
    assert not player.is_alive()
    (step,) = steps
    assert (step.reward, step.won, step.done, step.info["verifier_error"]) == (0.0, False, True, "timeout")
    sleeper.join(30)
    assert sleeper.exitcode == -signal.SIGKILL and rg._VERIFIER._proc is not sleeper  # killed mid-answer, replaced
    step = _play(task, "__import__('os')._exit(3)", cfg)[2]  # kills the (respawned) verifier process
    assert step.reward == 0.0 and step.info["verifier_error"].startswith("verifier process failed")
    assert _play(task, task.spec["answer"], cfg)[2].won  # a new one takes over


def test_task_json_round_trip_rebuilds_the_env():
    tasks = rg.make_tasks(_cfg(), CTX, "eval")
    wire = json.dumps([t.to_dict() for t in tasks], allow_nan=False)
    back = [Task.from_dict(d) for d in json.loads(wire)]
    assert back == tasks
    for task in back[:4]:
        assert set(task.spec) == {"dataset", "seed", "size", "index", "question", "answer", "metadata"}
        assert _play(task, task.spec["answer"])[2].won


def test_deterministic_pools_and_sizes():
    cfg = _cfg()
    a, b = rg.make_tasks(cfg, CTX, "train"), rg.make_tasks(cfg, CTX, "train")
    assert [t.to_dict() for t in a] == [t.to_dict() for t in b]
    assert len(a) == cfg.game_pool and len(rg.make_tasks(cfg, CTX, "eval")) == cfg.eval_pool
    assert len({t.task_id for t in a}) == len(a)
    other = rg.make_tasks(_cfg(seed=cfg.seed + 1), CTX, "train")
    assert {t.spec["question"] for t in other}.isdisjoint({t.spec["question"] for t in a})
    with pytest.raises(ValueError):
        rg.make_tasks(cfg, CTX, "test")


def test_train_eval_disjoint_default_dataset():
    cfg = _cfg()
    train = {t.spec["question"] for t in rg.make_tasks(cfg, CTX, "train")}
    eval_ = {t.spec["question"] for t in rg.make_tasks(cfg, CTX, "eval")}
    assert train.isdisjoint(eval_)


def test_eval_drops_questions_of_the_train_pool():
    # Short arithmetic repeats across seeds: at this size the raw eval items share questions with the
    # train pool, and the adapter must drop them (and duplicates within a split).
    cfg = _cfg(size=2000, game_pool=1500, eval_pool=1500)
    train = rg.make_tasks(cfg, CTX, "train")
    eval_ = rg.make_tasks(cfg, CTX, "eval")
    tq, eq = [t.spec["question"] for t in train], [t.spec["question"] for t in eval_]
    assert len(set(tq)) == len(tq) == 1500 and len(set(eq)) == len(eq) == 1500
    assert set(tq).isdisjoint(eq)
    seed = eval_[0].spec["seed"]
    raw = {e["question"] for _, e in rg._items("basic_arithmetic", seed, 1500)}
    assert raw & set(tq), "expected collisions between raw eval items and the train pool"


def test_second_dataset_round_robin():
    cfg = _cfg(datasets=("basic_arithmetic", "chain_sum"), game_pool=6)
    tasks = rg.make_tasks(cfg, CTX, "train")
    assert [t.category for t in tasks] == ["basic_arithmetic", "chain_sum"] * 3
    chain = [t for t in tasks if t.category == "chain_sum"]
    assert all(t.skill_key == "chain_sum" and t.task_id.startswith("rg-chain_sum-train-") for t in chain)
    _, first, step = _play(chain[0], chain[0].spec["answer"], cfg)
    assert "arithmetic problem" in first.observation and step.won and step.reward == 1.0
    assert _play(chain[1], str(int(chain[1].spec["answer"]) - 3), cfg)[2].reward == 0.0


def test_privileged_text_has_skills_and_reference_answer():
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    text = privileged_text("reasoning_gym", task, "both")
    assert "<answer></answer>" in text and "Multiplication and division" in text
    assert text.endswith(f"Walkthrough: answer: {task.spec['answer']}")
    assert "Walkthrough" not in privileged_text("reasoning_gym", task, "skills")


def test_overlong_question_is_capped():
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    long_task = Task.from_dict({**task.to_dict(), "spec": {**task.spec, "question": "Calculate 1 + 1. " * 500}})
    cfg = _cfg(max_observation_chars=100)
    first = rg.open_env(long_task, cfg, CTX).reset()
    assert len(first.observation) <= 100 and first.observation.endswith("...")
    assert first.observation.startswith("Calculate 1 + 1. Calculate")


def test_bad_datasets_and_specs_are_refused():
    refused = (("no_such_dataset", "unknown"), ("arc_agi", "JSON round trip"), ("composite", "cannot be built"))
    for name, words in refused:
        with pytest.raises(ValueError, match=words):
            rg.make_tasks(_cfg(datasets=(name,)), CTX, "train")
    with pytest.raises(ValueError, match="twice"):
        rg.make_tasks(_cfg(datasets=("chain_sum", "chain_sum")), CTX, "train")
    with pytest.raises(ValueError, match="raise reasoning_gym.size"):
        rg.make_tasks(_cfg(size=3, game_pool=8), CTX, "train")
    task = rg.make_tasks(_cfg(), CTX, "train")[0]
    with pytest.raises(ValueError, match="malformed"):
        rg.open_env(Task(task.task_id, task.category, {"dataset": "basic_arithmetic"}), _cfg(), CTX)
