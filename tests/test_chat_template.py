"""Chat templates: a model folder's template read as transformers reads it, rendered as transformers renders it
(renderings stored by tests/fixtures/make_chat_template_fixtures.py, and compared live when transformers is
installed), in a sandbox that refuses a template's reach into Python; clear errors for bad conversations."""

import json
import shutil
from pathlib import Path

import pytest

from gpt2_core import load_model
from gpt2_core.errors import CheckpointError, InvalidInputError
from gpt2_core.loading.chat_template import TemplateError, apply_chat_template, check_messages
from gpt2_core.loading.tokenizer import tokenizer_for_directory
from helpers import PACKAGE_DATA

pytest.importorskip("jinja2")
FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_templates.json").read_text())
EMBEDDED = PACKAGE_DATA / "embedded"
IDS = [f"{c['template']}-{len(c['messages'])}msg-{'gen' if c['add_generation_prompt'] else 'nogen'}"
       for c in FIXTURE["cases"]]


def tokenizer_folder(tmp_path: Path, **config) -> Path:
    """The embedded model's tokenizer, with ``config`` over its tokenizer_config.json."""
    shutil.copy(EMBEDDED / "tokenizer.json", tmp_path)
    base = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return tmp_path


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=IDS)
def test_a_folders_template_renders_as_transformers_renders_it(tmp_path, case):
    folder = tokenizer_folder(tmp_path, chat_template=FIXTURE["templates"][case["template"]],
                              **FIXTURE["special_tokens"])
    tokenizer = tokenizer_for_directory(folder)
    assert tokenizer.special_tokens == FIXTURE["special_tokens"]
    assert tokenizer.apply_chat_template(case["messages"], case["add_generation_prompt"]) == case["rendered"]


@pytest.mark.parametrize("case", FIXTURE["cases"][::3], ids=IDS[::3])
def test_the_stored_renderings_are_transformers_own(tmp_path, case):
    """Where transformers is installed: it renders the same template and conversation to the same text now."""
    transformers = pytest.importorskip("transformers")
    folder = tokenizer_folder(tmp_path, chat_template=FIXTURE["templates"][case["template"]],
                              **FIXTURE["special_tokens"], tokenizer_class="PreTrainedTokenizerFast")  # 4.x and 5.x
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template(case["messages"], tokenize=False,
                                  add_generation_prompt=case["add_generation_prompt"])
    assert want == case["rendered"]
    assert tokenizer_for_directory(folder).apply_chat_template(case["messages"], case["add_generation_prompt"]) == want


def test_where_the_template_is_read_from(tmp_path):
    """tokenizer_config.json's chat_template (text, or named templates of which "default"), overridden by a
    chat_template.jinja file as transformers does; special tokens as strings or AddedToken objects; none at all in
    the embedded model, whose chat then fails with a clear error."""
    folder = tokenizer_folder(tmp_path, chat_template=[{"name": "tool_use", "template": "T"},
                                                      {"name": "default", "template": "D{{ bos_token }}"}],
                              bos_token={"content": "<s>", "lstrip": False, "__type": "AddedToken"})
    tokenizer = tokenizer_for_directory(folder)
    assert tokenizer.chat_template == "D{{ bos_token }}" and tokenizer.special_tokens["bos_token"] == "<s>"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "D<s>"
    (folder / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert tokenizer_for_directory(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"
    embedded = load_model().tokenizer
    assert embedded.chat_template is None and embedded.special_tokens["eos_token"] == "<|endoftext|>"
    with pytest.raises(TemplateError, match="no chat template"):
        embedded.apply_chat_template([{"role": "user", "content": "x"}])
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer_config.json"):
        tokenizer_for_directory(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
    with pytest.raises(CheckpointError, match="chat_template must be text"):
        tokenizer_for_directory(folder)


def test_a_template_that_refuses_or_breaks_is_a_clear_error():
    llama2 = FIXTURE["templates"]["llama2"]
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="roles must alternate"):
        apply_chat_template(llama2, twice)
    with pytest.raises(TemplateError, match="not valid Jinja2"):
        apply_chat_template("{% for m in messages %}", [{"role": "user", "content": "a"}])
    with pytest.raises(TemplateError, match="failed on this conversation"):
        apply_chat_template("{{ messages[0].content + 1 }}", [{"role": "user", "content": "a"}])


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # the classic escape from a template into Python
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}",  # mutation
    "{{ messages[0].update({'content': 'changed'}) }}",
    "{{ raise_exception.__globals__['os'] }}",  # a function's globals
])
def test_the_sandbox_keeps_a_template_out_of_python(template):
    with pytest.raises(TemplateError):
        apply_chat_template(template, [{"role": "user", "content": "a"}])


def test_messages_are_checked_with_errors_that_name_the_message():
    assert check_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                            "name": "x"}]) == [{"role": "user", "content": "a\nb"}]
    for bad, where in [([], "non-empty list"), ("hello", "non-empty list"), ([["user", "a"]], r"messages\[0\]"),
                       ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], r"messages\[1\]\.role"),
                       ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
                       ([{"role": "user"}], r"messages\[0\]\.content"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "text only")]:
        with pytest.raises(InvalidInputError, match=where):
            check_messages(bad)
