"""flame/data/chat.py and the chat / preference pipelines of the loader (job.task sft and dpo)."""

import json

import pytest
import torch

from flame.data import build_dataloader
from flame.data.chat import ChatEncoder, PreferenceEncoder, load_chat_template
from flame.data.config import DataConfigError
from flame.data.tokenize import split_targets
from flame.loss import IGNORE_INDEX
from tests.data.helpers import ASSETS, job_config

TEMPLATE = (ASSETS / "chat_template.jinja").read_text()
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "3 + 4 = 7."},
    {"role": "user", "content": "And 1 + 1?"},
    {"role": "assistant", "content": "2."},
]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_only_the_assistant_replies_and_their_end_of_turn_are_targets(tokenizer):
    ids, is_target = split_targets(ChatEncoder(tokenizer, TEMPLATE).encode(CONVERSATION))
    assert tokenizer.decode(ids) == (
        "<s><|system|>\nBe brief.\n<|user|>\nWhat is 3 + 4?\n<|assistant|>\n3 + 4 = 7.</s>\n"
        "<|user|>\nAnd 1 + 1?\n<|assistant|>\n2.</s>\n"
    )
    # The targets are exactly the two replies, each closed by EOS and the template's newline.
    runs, start = [], None
    for i, target in enumerate([*is_target.tolist(), False]):
        if target and start is None:
            start = i
        elif not target and start is not None:
            runs.append(tokenizer.decode(ids[start:i]))
            start = None
    assert runs == ["3 + 4 = 7.</s>\n", "2.</s>\n"]


def test_prompt_and_response_columns_are_one_user_and_one_assistant_turn(tokenizer):
    encoder = ChatEncoder(tokenizer, TEMPLATE)
    [from_columns] = encoder([{"prompt": "What is 3 + 4?", "response": "3 + 4 = 7."}])
    expected = encoder.encode(CONVERSATION[1:3])
    assert from_columns.tokens.tolist() == expected.tolist()


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"messages": []}, "no messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}, "empty"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "starts with an assistant message"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role in"),
    ],
)
def test_a_bad_chat_row_stops_in_one_line_naming_the_row(tmp_path, tokenizer, row, reason):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 5
    rows[3] = row
    path = write_rows(tmp_path / "chat.jsonl", rows)
    config = job_config("--job.task", "sft", "--training.chat_template", str(ASSETS / "chat_template.jinja"),
                        dataset=str(path), seq_len=16, batch_size=1)  # fmt: skip
    loader = build_dataloader(config, tokenizer)
    with pytest.raises(DataConfigError, match=rf"chat\.jsonl.*, row 3: .*{reason}"):
        for _ in zip(range(50), loader):
            pass


def test_a_pair_with_one_reply_twice_is_refused_at_once(tmp_path, tokenizer):
    path = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "1 + 1?", "chosen": "2.", "rejected": "2."}])
    config = job_config("--job.task", "dpo", "--training.chat_template", str(ASSETS / "chat_template.jinja"),
                        dataset=str(path), seq_len=16, batch_size=1)  # fmt: skip
    with pytest.raises(DataConfigError, match=r"pairs\.jsonl.*row 0: chosen and rejected are the same reply"):
        build_dataloader(config, tokenizer)


def test_a_tokenizer_without_chat_template_needs_the_file_option(tokenizer):
    with pytest.raises(DataConfigError, match="has no chat template; pass --training.chat_template"):
        load_chat_template(tokenizer, None)
    assert load_chat_template(tokenizer, str(ASSETS / "chat_template.jinja")) == TEMPLATE


def test_chat_data_without_its_columns_names_them(tmp_path, tokenizer):
    path = write_rows(tmp_path / "texts.jsonl", [{"text": "hello"}])
    config = job_config("--job.task", "sft", "--training.chat_template", str(ASSETS / "chat_template.jinja"),
                        dataset=str(path), seq_len=16, batch_size=1)  # fmt: skip
    with pytest.raises(
        DataConfigError, match=r"has no chat columns \('messages' or 'prompt' \+ 'response'\)"
    ):
        build_dataloader(config, tokenizer)


def test_sft_batches_label_the_replies_only_and_keep_documents_apart(tokenizer):
    config = job_config("--job.task", "sft", "--training.chat_template", str(ASSETS / "chat_template.jinja"),
                        dataset=str(ASSETS / "chat"), seq_len=96, batch_size=1, varlen=True)  # fmt: skip
    inputs, labels = next(iter(build_dataloader(config, tokenizer)))
    tokens, labels = inputs["input"][0], labels[0]
    targets = tokenizer.decode(labels[labels != IGNORE_INDEX])
    # Every reply "a op b = c." is a target, with its EOS; no question is.
    assert "What is" not in targets and targets.count("</s>") >= 2
    assert "What is" in tokenizer.decode(tokens)
    assert len(inputs["cu_seqlens"]) >= 3  # several conversations, each its own sequence
    for start in inputs["cu_seqlens"][1:-1]:
        assert labels[start - 1] == IGNORE_INDEX  # a conversation's last token has no target


def test_dpo_batches_hold_the_chosen_rows_then_the_rejected_rows(tokenizer):
    config = job_config("--job.task", "dpo", "--training.chat_template", str(ASSETS / "chat_template.jinja"),
                        dataset=str(ASSETS / "preference"), seq_len=48, batch_size=3)  # fmt: skip
    inputs, labels = next(iter(build_dataloader(config, tokenizer)))
    assert inputs["input"].shape == labels.shape == (6, 48)
    rows = [json.loads(line) for line in (ASSETS / "preference" / "train.jsonl").read_text().splitlines()]
    replies = [tokenizer.decode(row[labels[i] != IGNORE_INDEX]) for i, row in enumerate(labels)]
    prompts = [tokenizer.decode(row) for row in inputs["input"]]
    for i in range(3):
        # Row i and row i + 3 are one pair: the same prompt, the chosen and the rejected reply as targets.
        assert prompts[i].split("<|assistant|>")[0] == prompts[i + 3].split("<|assistant|>")[0]
        pair = next(r for r in rows if r["prompt"] in prompts[i])
        assert replies[i] == pair["chosen"] + "</s>\n" and replies[i + 3] == pair["rejected"] + "</s>\n"


def test_preference_encoder_accepts_message_replies_and_conversation_prompts(tokenizer):
    encoder = PreferenceEncoder(tokenizer, TEMPLATE)
    [plain] = encoder([{"prompt": "What is 3 + 4?", "chosen": "7.", "rejected": "8."}])
    [as_messages] = encoder(
        [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}],
          "chosen": [{"role": "assistant", "content": "7."}], "rejected": {"role": "assistant", "content": "8."}}]
    )  # fmt: skip
    for a, b in zip(plain.tokens, as_messages.tokens):
        assert torch.equal(torch.from_numpy(a), torch.from_numpy(b))
