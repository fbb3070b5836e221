import asyncio
import copy

import pytest

from burstrl.envs import get_env, toy
from burstrl.envs.toy_multi import MAX_TOKENS, REWARD_WEIGHTS, MultiToyEnv, grade


class ScriptedClient:
    """A session's chat client that answers from a script and records what it was sent."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.calls = 0
        self.sent: list[list[dict[str, str]]] = []
        self.max_tokens: list[int | None] = []

    async def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None) -> str:
        self.sent.append(copy.deepcopy(messages))
        self.max_tokens.append(max_tokens)
        self.calls += 1
        return self.replies[self.calls - 1]


def _task(letters: str):
    env = MultiToyEnv()
    task = env.make_tasks(1, seed=0, difficulty=len(letters))[0]
    task.data["letters"] = list(letters)
    return env, task


def test_each_call_carries_the_whole_conversation_with_the_actual_replies():
    env, task = _task("KQZ")
    client = ScriptedClient([" K\n", "the letter Q", "Z"])
    outcome = asyncio.run(env.rollout(client, task))
    assert client.calls == 3 and client.max_tokens == [MAX_TOKENS] * 3
    system = {"role": "system", "content": toy.SYSTEM_PROMPT}
    user = [{"role": "user", "content": f"Repeat the letter: {c}"} for c in "KQZ"]
    assert client.sent[0] == [system, user[0]]
    assert client.sent[1] == [system, user[0], {"role": "assistant", "content": " K\n"}, user[1]]
    assert client.sent[2] == client.sent[1] + [{"role": "assistant", "content": "the letter Q"}, user[2]]
    assert outcome.info["replies"] == [" K\n", "the letter Q", "Z"]
    assert outcome.parts == pytest.approx({"exact": 2 / 3, "format": 2 / 3})
    assert outcome.reward == pytest.approx(0.8 * 2 / 3 + 0.2 * 2 / 3)
    assert not outcome.passed


def test_first_turn_is_the_single_letter_toy_chat():
    """So the warm start on `toy` transfers to the first turn unchanged."""
    env, task = _task("K")
    client = ScriptedClient(["K"])
    asyncio.run(env.rollout(client, task))
    assert client.sent[0] == toy.messages(toy.ToyTask(id="t", prompt="Repeat the letter: K", answer="K", difficulty=1))


@pytest.mark.parametrize(
    "letters, replies, total, parts, passed",
    [
        ("KQ", ["K", "Q"], 1.0, {"exact": 1, "format": 1}, True),
        ("KQ", ["K", "X"], 0.6, {"exact": 0.5, "format": 1}, False),
        ("KQ", ["k", "q"], 0.2, {"exact": 0, "format": 1}, False),  # case matters
        ("KQ", ["KK", ""], 0.0, {"exact": 0, "format": 0}, False),
        ("K", ["K."], 0.0, {"exact": 0, "format": 0}, False),
        ("KQZA", ["K", "Q", "Z", "A"], 1.0, {"exact": 1, "format": 1}, True),
    ],
)
def test_rewards_and_pass(letters, replies, total, parts, passed):
    env, task = _task(letters)
    outcome = asyncio.run(env.rollout(ScriptedClient(replies), task))
    assert outcome.parts == pytest.approx(parts)
    assert outcome.reward == pytest.approx(total)
    assert outcome.passed is passed
    assert outcome.reward == pytest.approx(sum(REWARD_WEIGHTS[k] * v for k, v in outcome.parts.items()), abs=1e-6)
    assert 0.0 <= outcome.reward <= 1.0


def test_perfect_rollout_scores_exactly_one():
    assert grade(list("ABCD"), list("ABCD"))[0] == 1.0
    with pytest.raises(ValueError):
        grade(["A"], [])


def test_tasks_are_deterministic_with_unique_ids_and_difficulty_turns():
    env = MultiToyEnv()
    a = env.make_tasks(20, seed=3, difficulty=3)
    assert a == env.make_tasks(20, seed=3, difficulty=3)
    assert [t.data for t in a] != [t.data for t in env.make_tasks(20, seed=4, difficulty=3)]
    test = env.make_tasks(20, seed=3, difficulty=3, split="test")
    assert [t.data for t in a] != [t.data for t in test]
    ids = [t.id for t in a + test + env.make_tasks(20, seed=4, difficulty=3) + env.make_tasks(20, seed=3)]
    assert len(set(ids)) == len(ids)
    for task in a:
        letters = task.data["letters"]
        assert task.env == "toy_multi" and task.difficulty == 3 and len(letters) == 3
        assert all(c in toy.LETTERS for c in letters)
        assert all(x != y for x, y in zip(letters, letters[1:], strict=False))  # never "repeat your last reply"


@pytest.mark.parametrize("kwargs", [{"n": -1}, {"difficulty": 0}, {"difficulty": 5}, {"split": "dev"}])
def test_make_tasks_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        MultiToyEnv().make_tasks(**{"n": 1, "seed": 0, **kwargs})


def test_demonstrations_are_the_whole_conversation_with_right_replies():
    env = MultiToyEnv()
    tasks = env.make_tasks(4, seed=0, difficulty=3)
    rows = env.demonstrations(tasks)
    assert len(rows) == 4
    for task, row in zip(tasks, rows, strict=False):
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3
        assert [m["content"] for m in msgs[2::2]] == task.data["letters"]
        # Replaying the demonstration's replies through a rollout passes.
        outcome = asyncio.run(env.rollout(ScriptedClient(task.data["letters"]), task))
        assert outcome.passed and outcome.reward == 1.0


def test_get_env_registers_toy_multi():
    env = get_env("toy_multi")
    assert isinstance(env, MultiToyEnv) and env.name == "toy_multi" and env.max_difficulty == 4
    with pytest.raises(ValueError, match="toy_multi"):
        get_env("nope")
