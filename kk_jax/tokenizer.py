"""Tokenizer of an HF checkpoint directory: ``tokenizer.json`` + ``tokenizer_config.json``
(chat template, special tokens) + ``generation_config.json`` (eos ids)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from kk_jax.chat.encoders import ChatEncoder, chat_encoder_for


class TokenizerError(ValueError):
    """The checkpoint's tokenizer files are missing or unusable."""


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found: the checkpoint directory needs a tokenizer.json "
                                 "(Hugging Face fast-tokenizer format)")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        self.chat_template: str | None = cfg.get("chat_template")
        if self.chat_template is None and (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()    # transformers >= 4.43 layout
        self.bos_token = self._token_str(cfg.get("bos_token"))
        self.eos_token = self._token_str(cfg.get("eos_token"))
        gen = _read_json(model_dir / "generation_config.json")
        eos = gen.get("eos_token_id", _read_json(model_dir / "config.json").get("eos_token_id"))
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not ids and self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids = [self._tok.token_to_id(self.eos_token)]
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in ids)
        self.vocab_size = self._tok.get_vocab_size()
        # prompt encoder chosen by the model's config (DS4.1 is Python; the rest use the template)
        self.chat_encoder: ChatEncoder | None = chat_encoder_for(
            _read_json(model_dir / "config.json"), self.chat_template, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "")

    @staticmethod
    def _token_str(tok) -> str | None:
        return tok.get("content") if isinstance(tok, dict) else tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text of a conversation (OpenAI-shaped messages, optional OpenAI tools);
        ``kwargs`` are the chat template's switches (e.g. ``enable_thinking``)."""
        if self.chat_encoder is None:
            raise TokenizerError("this checkpoint has no chat_template in tokenizer_config.json; "
                                 "use completions with a plain prompt instead")
        return self.chat_encoder.encode(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte
    characters: text is emitted only once the bytes decode to complete characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, new_ids: list[int]) -> str:
        delta = ""
        for i in new_ids:
            self.ids.append(i)
            prefix_text = self.tok.decode(self.ids[self._prefix:self._read])
            full = self.tok.decode(self.ids[self._prefix:])
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                delta += full[len(prefix_text):]
                self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta
