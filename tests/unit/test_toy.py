import json

import pytest

from burstrl.envs import toy


def test_tasks_are_deterministic_and_distinct_by_seed_and_split():
    a = toy.make_tasks(20, seed=3)
    assert a == toy.make_tasks(20, seed=3)
    assert [t.answer for t in a] != [t.answer for t in toy.make_tasks(20, seed=4)]
    test = toy.make_tasks(20, seed=3, split="test")
    assert [t.answer for t in a] != [t.answer for t in test]
    ids = [t.id for t in a + test + toy.make_tasks(20, seed=4)]
    assert len(set(ids)) == len(ids)


def test_tasks_have_the_asked_number_of_letters():
    for difficulty in (1, 2, 3):
        for task in toy.make_tasks(30, seed=0, difficulty=difficulty):
            assert len(task.answer) == difficulty and task.answer.isupper()
            assert task.prompt.endswith(": " + task.answer)
            assert task.difficulty == difficulty
    assert toy.make_tasks(1, seed=0)[0].prompt.startswith("Repeat the letter: ")
    assert toy.make_tasks(1, seed=0, difficulty=2)[0].prompt.startswith("Repeat the letters: ")


@pytest.mark.parametrize("kwargs", [{"n": -1}, {"difficulty": 0}, {"difficulty": 99}, {"split": "dev"}])
def test_make_tasks_rejects_bad_arguments(kwargs):
    args = {"n": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError):
        toy.make_tasks(**args)


def _task(answer: str) -> toy.ToyTask:
    return toy.ToyTask(id="t", prompt=f"Repeat: {answer}", answer=answer, difficulty=len(answer))


@pytest.mark.parametrize(
    "answer, reply, total, parts",
    [
        ("K", "K", 1.0, {"exact": 1, "prefix": 1, "format": 1}),
        ("K", "  K\n", 1.0, {"exact": 1, "prefix": 1, "format": 1}),
        ("K", "Q", 0.1, {"exact": 0, "prefix": 0, "format": 1}),
        ("K", "k", 0.1, {"exact": 0, "prefix": 0, "format": 1}),  # case matters
        ("K", "KK", 0.3, {"exact": 0, "prefix": 1, "format": 0}),  # right, then chatter
        ("K", "K.", 0.3, {"exact": 0, "prefix": 1, "format": 0}),
        ("K", "", 0.0, {"exact": 0, "prefix": 0, "format": 0}),
        ("K", "the letter K", 0.0, {"exact": 0, "prefix": 0, "format": 0}),
        ("KQZ", "KQX", 0.3, {"exact": 0, "prefix": 2 / 3, "format": 1}),
        ("KQZ", "KXZ", 0.2, {"exact": 0, "prefix": 1 / 3, "format": 1}),
        ("KQZ", "KQ", 0.2, {"exact": 0, "prefix": 2 / 3, "format": 0}),
        ("KQZ", "K Q Z", 0.1, {"exact": 0, "prefix": 1 / 3, "format": 0}),
    ],
)
def test_reward_parts(answer, reply, total, parts):
    got_total, got_parts = toy.reward(_task(answer), reply)
    assert got_parts == pytest.approx(parts)
    assert got_total == pytest.approx(total)
    assert got_total == pytest.approx(sum(toy.REWARD_WEIGHTS[k] * v for k, v in got_parts.items()), abs=1e-6)


def test_perfect_reply_scores_exactly_one():
    assert toy.reward(_task("ABC"), "ABC")[0] == 1.0


def test_demonstrations_render_through_the_chat_template(tiny_model_dir, tmp_path):
    from burstrl.model.hf import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    tasks = toy.make_tasks(3, seed=0, difficulty=2)
    rows = toy.demonstrations(tasks)
    for task, row in zip(tasks, rows, strict=False):
        assert row["messages"][:-1] == toy.messages(task)
        assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert text.startswith(f"<|im_start|>system\n{toy.SYSTEM_PROMPT}<|im_end|>\n")
        assert f"<|im_start|>user\n{task.prompt}<|im_end|>\n" in text
        assert text.endswith(f"<|im_start|>assistant\n{task.answer}<|im_end|>\n")
    path = toy.write_jsonl(rows, tmp_path / "sub" / "demos.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows
