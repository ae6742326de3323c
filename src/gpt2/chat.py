"""Chat templates: a list of chat messages -> the one prompt string a model continues.

    from gpt2.chat import ChatTemplate
    template = ChatTemplate.default()                    # or ChatTemplate.from_file("chatml.jinja")
    template.render([{"role": "user", "content": "Hi"}])  # 'User: Hi\\n\\nAssistant:'
    gpt2 serve --model gpt2 --chat-template chatml.jinja  # POST /v1/chat/completions uses it

GPT-2 is a base model: it was never trained on a chat format, so the default is plain text a base model
can continue. Each message is its role, capitalized, a colon and its content, with a blank line between
messages; the prompt ends with "Assistant:" for the model to go on from:

    System: You are terse.

    User: Hi

    Assistant:

A template file is Jinja, as Transformers' `chat_template` and vLLM's `--chat-template` are: it sees
`messages` (a list of {"role", "content"}), `add_generation_prompt` (always true here), and
`bos_token` / `eos_token` (both "<|endoftext|>", GPT-2's one special token). It runs in Jinja's
immutable sandbox, as Transformers runs them, since a template is code. The rendered prompt may hold
"<|endoftext|>", which becomes the special token.
"""

from __future__ import annotations

from pathlib import Path

from gpt2.tokenizer import ENDOFTEXT
from gpt2.errors import ConfigError, GPT2Error

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message.role | capitalize }}: {{ message.content }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(GPT2Error, ValueError):
    """A chat template does not render these messages (it raised, or used an undefined name)."""


class ChatTemplate:
    def __init__(self, source: str, name: str = "the default chat template"):
        from jinja2 import StrictUndefined, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        try:
            self.template = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ConfigError(f"{name}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
        self.source, self.name = source, name

    @classmethod
    def default(cls) -> "ChatTemplate":
        return cls(DEFAULT_CHAT_TEMPLATE)

    @classmethod
    def from_file(cls, path: str | Path) -> "ChatTemplate":
        p = Path(path)
        try:
            source = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: cannot read the chat template ({e.__class__.__name__})") from None
        return cls(source, name=str(p))

    def render(self, messages: list[dict]) -> str:
        """The prompt for these messages ({"role", "content"} dicts), ready for the model to continue."""
        from jinja2 import TemplateError
        try:
            return self.template.render(messages=messages, add_generation_prompt=True,
                                        bos_token=ENDOFTEXT, eos_token=ENDOFTEXT)
        except TemplateError as e:  # the messages' fault or the template's: either way, not a crash
            raise ChatTemplateError(f"the chat template does not render these messages: {e}") from None
