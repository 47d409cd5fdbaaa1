"""PML with the embedded SmolLM2 tokenizer (ChatML template, default system message)."""

from __future__ import annotations

import pytest

from pckernels.pml import ROOT, parse_prompt, parse_schema, role_format

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


def chat_ids(tokenizer, messages, generation):
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
    return tuple(out["input_ids"] if hasattr(out, "keys") else out)


def test_role_affixes_are_chatml(tokenizer):
    roles = role_format(tokenizer)
    assert roles.affixes["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert roles.affixes["system"] == ("<|im_start|>system\n", "<|im_end|>\n")
    assert roles.generation_prompt == "<|im_start|>assistant\n"
    assert roles.conversation_start == ""


def test_schema_and_prompt_match_apply_chat_template(tokenizer):
    schema = parse_schema("""
        <schema name="chat">
          <system>You are a concise travel guide.</system>
          <user>
            <module name="miami">Miami is a coastal city in Florida.</module>
            Answer the question.
          </user>
        </schema>""", tokenizer, max_positions=8192)
    assert schema.modules[ROOT].token_ids[:1] == (tokenizer.convert_tokens_to_ids("<|im_start|>"),)
    prompt = parse_prompt('<prompt schema="chat"><miami/><user>Is it warm?</user><assistant/></prompt>',
                          {"chat": schema})
    expected = chat_ids(tokenizer, [
        {"role": "system", "content": "You are a concise travel guide."},
        {"role": "user", "content": "Miami is a coastal city in Florida.Answer the question."},
        {"role": "user", "content": "Is it warm?"},
    ], generation=True)
    assert prompt.token_ids == expected
    assert prompt.position_ids == tuple(range(len(expected)))


def test_user_tag_alone_has_no_default_system_message(tokenizer):
    schema = parse_schema('<schema name="u"><user>Hi</user></schema>', tokenizer)
    full = chat_ids(tokenizer, [{"role": "user", "content": "Hi"}], generation=False)
    assert full[-len(schema.modules[ROOT].token_ids):] == schema.modules[ROOT].token_ids
    assert "SmolLM" not in tokenizer.decode(list(schema.modules[ROOT].token_ids))


def test_placeholder_is_unk(tokenizer):
    schema = parse_schema('<schema name="p"><module name="m">Go <param name="x" len="3"/></module>'
                          "</schema>", tokenizer)
    assert schema.placeholder_token_id == tokenizer.unk_token_id
    assert schema.modules["m"].token_ids[-3:] == (tokenizer.unk_token_id,) * 3
