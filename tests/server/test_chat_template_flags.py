"""``--chat-template`` and ``--chat-template-args``, as mlx_lm.server's flags: a template (here
from a file) in place of the tokenizer's, and arguments every chat's template gets, which a
request's ``chat_template_kwargs`` override. The demo pair's tokenizer has no template of its
own; a chat through the flag's template is the completion of the prompt it renders."""

import jinja2
import pytest
from support.processes import run_module

from benchmarks.harness.server_process import ServerProcess

pytestmark = pytest.mark.subprocess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if style == 'code' %}def {% endif %}{% endif %}")
ASK = [{"role": "system", "content": "You write Python."},
       {"role": "user", "content": "A function that adds two numbers."}]


def rendered(style: str) -> str:
    # the environment settings transformers renders chat templates with
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(
        messages=ASK, add_generation_prompt=True, style=style)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(TEMPLATE)
    s = ServerProcess("--chat-template", str(path), "--chat-template-args", '{"style": "code"}',
                      "--block-size", "3", "--log-level", "warning")
    s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield s
    s.stop()


def chat(server, **kwargs):
    r = server.client.chat.completions.create(model="demo", messages=ASK, max_tokens=12,
                                              temperature=0, **kwargs)
    return r.choices[0].message.content, r.usage.prompt_tokens


def complete(server, prompt: str):
    r = server.client.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                         temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens


def test_a_chat_is_the_completion_of_the_flags_template_with_its_args(server):
    assert rendered("code").endswith("<|im_start|>assistant\ndef ")
    assert chat(server) == complete(server, rendered("code"))


def test_a_requests_kwargs_override_the_flags_args(server):
    got = chat(server, extra_body={"chat_template_kwargs": {"style": "prose"}})
    assert got == complete(server, rendered("prose"))
    assert got != chat(server)


@pytest.mark.parametrize("args, message", [
    (["--chat-template", "{% if %}"],
     "error: argument --chat-template: not a Jinja template (line 1: Expected an expression, "
     "got 'end of statement block')"),
    (["--chat-template-args", "{"],
     "error: argument --chat-template-args: not JSON (Expecting property name enclosed in "
     "double quotes at character 1)"),
    (["--chat-template-args", "[1]"],
     "error: argument --chat-template-args: expected a JSON object, e.g. "
     "'{\"enable_thinking\": false}'"),
    (["--chat-template-args", '{"style": "code"}'],
     "error: --chat-template-args: this model's tokenizer has no chat template (give one with "
     "--chat-template)"),
])
def test_bad_template_flags_are_one_line_errors(args, message):
    r = run_module("mlx_mtp.server", *args, check=False)
    assert r.returncode != 0 and r.stderr == message + "\n"
