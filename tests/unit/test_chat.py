import pytest

from burstrl.inference.chat import ChatError, ChatTokenizer, normalize_messages
from burstrl.inference.sessions import ReplicaSession


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _im_end(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def _noncanonical(tokenizer, text):
    """Ids that decode to `text` but are not what tokenizing `text` gives: one id per character."""
    ids = [i for ch in text for i in _encode(tokenizer, ch)]
    assert tokenizer.decode(ids) == text
    assert ids != _encode(tokenizer, text)
    return ids


def _finish(tokenizer, session, messages, prompt_ids, sampled):
    """What engine.Engine._finish leaves on the session after a chat call."""
    session.messages = messages
    session.prompt_ids = prompt_ids
    session.completion_ids = sampled
    session.completion_text = tokenizer.decode(sampled, skip_special_tokens=True)


FIRST = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def _first_call(chat, tokenizer, sampled_text, with_end):
    session = ReplicaSession(id="s", version="base")
    messages = normalize_messages(FIRST)
    p1 = chat.prompt_ids(messages, session)
    assert p1 == _encode(tokenizer, chat.render(messages, generation_prompt=True))
    assert chat.continued == 0 and chat.breaks == 0
    sampled = _noncanonical(tokenizer, sampled_text) + ([_im_end(tokenizer)] if with_end else [])
    _finish(tokenizer, session, messages, p1, sampled)
    return session, messages, p1, sampled


def test_continuation_reuses_sampled_ids_verbatim(chat, tokenizer):
    session, messages, p1, sampled = _first_call(chat, tokenizer, "The answer is four.", with_end=True)
    reply = {"role": "assistant", "content": session.completion_text}
    assert reply["content"] == "The answer is four."
    messages2 = normalize_messages(messages + [reply, {"role": "user", "content": "And 3 + 3?"}])
    p2 = chat.prompt_ids(messages2, session)
    rest = _encode(tokenizer, "\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert p2 == p1 + sampled + rest
    assert p2[len(p1):len(p1) + len(sampled)] == sampled
    assert chat.continued == 1 and chat.breaks == 0
    # same text as the template, different ids than re-tokenizing it
    full_text = chat.render(messages2, generation_prompt=True)
    assert tokenizer.decode(p2) == full_text
    assert p2 != _encode(tokenizer, full_text)


def test_continuation_without_end_token_bridges_with_im_end(chat, tokenizer):
    session, messages, p1, sampled = _first_call(chat, tokenizer, "The answer is", with_end=False)
    reply = {"role": "assistant", "content": "The answer is"}
    messages2 = messages + [reply, {"role": "user", "content": "Go on."}]
    p2 = chat.prompt_ids(messages2, session)
    bridge = p2[len(p1) + len(sampled):]
    assert p2[:len(p1) + len(sampled)] == p1 + sampled
    assert bridge[0] == _im_end(tokenizer)
    assert bridge == _encode(tokenizer, "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(p2) == chat.render(messages2, generation_prompt=True)
    assert chat.continued == 1 and chat.breaks == 0


def test_continuation_chains_over_several_calls(chat, tokenizer):
    session, messages, p1, sampled = _first_call(chat, tokenizer, "four", with_end=True)
    messages2 = messages + [{"role": "assistant", "content": "four"}, {"role": "tool", "content": "ok"}]
    p2 = chat.prompt_ids(messages2, session)
    sampled2 = _noncanonical(tokenizer, "Done now") + [_im_end(tokenizer)]
    _finish(tokenizer, session, messages2, p2, sampled2)
    messages3 = messages2 + [{"role": "assistant", "content": "Done now"},
                             {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    p3 = chat.prompt_ids(messages3, session)
    assert p3[:len(p1)] == p1
    assert p3[:len(p2) + len(sampled2)] == p2 + sampled2
    assert p2[len(p1):len(p1) + len(sampled)] == sampled
    assert tokenizer.decode(p3) == chat.render(messages3, generation_prompt=True)
    assert chat.continued == 2 and chat.breaks == 0


def _full(chat, tokenizer, messages):
    return _encode(tokenizer, chat.render(messages, generation_prompt=True))


@pytest.mark.parametrize("edit", ["system", "user", "assistant", "role", "drop_first"])
def test_edited_history_falls_back_and_counts_break(chat, tokenizer, edit):
    session, messages, p1, sampled = _first_call(chat, tokenizer, "The answer is four.", with_end=True)
    history = [dict(m) for m in messages]
    reply = {"role": "assistant", "content": session.completion_text}
    if edit == "system":
        history[0]["content"] = "Be verbose."
    elif edit == "user":
        history[1]["content"] = "What is 2 + 3?"
    elif edit == "assistant":
        reply["content"] = "The answer is 4."
    elif edit == "role":
        reply["role"] = "user"
    elif edit == "drop_first":
        history = history[1:]
    messages2 = history + [reply, {"role": "user", "content": "Next?"}]
    p2 = chat.prompt_ids(messages2, session)
    assert p2 == _full(chat, tokenizer, messages2)
    assert chat.breaks == 1 and chat.continued == 0


def test_stop_string_cut_falls_back(chat, tokenizer):
    session, messages, p1, sampled = _first_call(chat, tokenizer, "four STOP more", with_end=False)
    session.completion_text = "four "  # what engine._hit_stop keeps
    messages2 = messages + [{"role": "assistant", "content": "four "}, {"role": "user", "content": "x"}]
    p2 = chat.prompt_ids(messages2, session)
    assert p2 == _full(chat, tokenizer, messages2)
    assert chat.breaks == 1


def test_no_new_message_after_reply_falls_back(chat, tokenizer):
    session, messages, _, _ = _first_call(chat, tokenizer, "four", with_end=True)
    messages2 = messages + [{"role": "assistant", "content": "four"}]
    assert chat.prompt_ids(messages2, session) == _full(chat, tokenizer, messages2)
    assert chat.breaks == 1
    # a shorter conversation than before
    assert chat.prompt_ids(messages[:1], session) == _full(chat, tokenizer, messages[:1])
    assert chat.breaks == 2


def test_fresh_session_is_not_a_break(chat, tokenizer):
    session = ReplicaSession(id="s", version="base")
    messages = normalize_messages(FIRST)
    assert chat.prompt_ids(messages, session) == _full(chat, tokenizer, messages)
    assert chat.breaks == 0 and chat.continued == 0


def test_tokenizer_without_template_is_refused(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ChatError, match="chat template"):
        ChatTokenizer(NoTemplate())


def test_normalize_messages_joins_text_parts_and_defaults_content():
    out = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "developer", "content": "d", "name": "x"},
    ])
    assert out == [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""},
                   {"role": "developer", "content": "d"}]


@pytest.mark.parametrize("messages, word", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    ({"role": "user", "content": "x"}, "non-empty list"),
    (["hello"], r"messages\[0\]"),
    ([{"content": "x"}], "role"),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}], r"messages\[1\].*role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text"),
    ([{"role": "user", "content": ["plain string part"]}], "only text"),
    ([{"role": "user", "content": 42}], "must be a string"),
    ([{"role": "user", "content": {"text": "x"}}], "must be a string"),
])
def test_normalize_messages_errors(messages, word):
    with pytest.raises(ChatError, match=word):
        normalize_messages(messages)
    assert issubclass(ChatError, ValueError)


@pytest.mark.parametrize("text", [5, None, ["a"]])
def test_normalize_messages_non_string_text_part_is_chat_error(text):
    with pytest.raises(ChatError):
        normalize_messages([{"role": "user", "content": [{"type": "text", "text": text}]}])
