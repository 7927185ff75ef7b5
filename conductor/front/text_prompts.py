"""Text prompts and chat for the front (``conductor serve --tokenizer DIR``), for
instances that cannot tokenize.

Instances that tokenize get text and chat requests unchanged (``http_front``); these
routes are for instances run with ``--skip-tokenizer-init`` (token ids in, token ids out),
where the front owns the text side: it encodes the prompt (or renders the chat template
and encodes that), sends token ids, asks for ``return_token_ids`` and writes the decoded
text into the answer, streamed or not, every choice of it (``n``), and passes the
usage chunk of ``stream_options.include_usage`` through in the answer's own shape. What
needs the instance's tokenizer is refused with a 400 (chat ``logprobs``: their tokens'
text).

``DIR`` holds a Hugging Face fast tokenizer: ``tokenizer.json`` (read with the
``tokenizers`` library, no torch), and optionally ``tokenizer_config.json`` with a
``chat_template`` (Jinja, rendered with ``jinja2``) and ``bos_token``/``eos_token``.
Both libraries are in the ``text`` extra.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conductor.front.openai_api import error_body
from conductor.front.replies import JsonReply, Reply, StreamReply
from conductor.front.sse_reply import StreamedReply
from conductor.front.vllm_front import VllmFront


class TextError(ValueError):
    """A tokenizer directory or a chat request the front cannot use."""


def _special(cfg: dict[str, Any], name: str) -> str:
    v = cfg.get(name) or ""
    return str(v.get("content", "")) if isinstance(v, dict) else str(v)


class TextCodec:
    def __init__(self, tokenizer: Any, *, chat_template: str | None, bos: str, eos: str
                 ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos, self.eos = bos, eos
        self._template: Any = None

    @classmethod
    def load(cls, directory: Path) -> TextCodec:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TextError("--tokenizer needs the 'tokenizers' package (the 'text' "
                            "extra)") from None
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise TextError(f"{directory}: no tokenizer.json (a Hugging Face fast tokenizer)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise TextError(f"{path}: not a tokenizer: {exc}") from None
        cfg: dict[str, Any] = {}
        cfg_path = Path(directory) / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except ValueError as exc:
                raise TextError(f"{cfg_path}: {exc}") from None
        template = cfg.get("chat_template")
        jinja = Path(directory) / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        return cls(tok, chat_template=template if isinstance(template, str) else None,
                   bos=_special(cfg, "bos_token"), eos=_special(cfg, "eos_token"))

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def render_chat(self, messages: Any) -> str:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise TextError("messages must be a non-empty list of {role, content} objects "
                            "with string content")
        if self._template is None:
            import jinja2

            env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False,
                                     trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template or "")
        try:
            return str(self._template.render(messages=messages, add_generation_prompt=True,
                                             bos_token=self.bos, eos_token=self.eos))
        except Exception as exc:
            raise TextError(f"chat template failed: {exc}") from exc  # the template's line

    # ---- the two routes ----------------------------------------------------------------

    async def completions(self, front: VllmFront, request: Request, body: dict[str, Any],
                          run: Callable[..., Any], *, session: str | None = None
                          ) -> Response:
        ids = self.encode(body["prompt"])
        if not ids:
            return JSONResponse(error_body(400, "the prompt encodes to no tokens"), 400)
        want_ids = bool(body.get("return_token_ids"))
        up = {**body, "prompt": ids, "return_token_ids": True}
        reply: Reply | None = await run(request, front.complete(up, route="completions",
                                                                session=session))
        return self._respond(reply, want_ids, chat=False, model=front.model)

    async def chat(self, front: VllmFront, request: Request, body: dict[str, Any],
                   run: Callable[..., Any], *, session: str | None = None) -> Response:
        try:
            if body.get("logprobs") or body.get("top_logprobs"):
                raise TextError("chat logprobs need instances that tokenize (vLLM without "
                                "--skip-tokenizer-init): the front cannot name their tokens")
            ids = self.encode(self.render_chat(body.get("messages")))
        except TextError as exc:
            front.metrics.requests.labels("chat", "bad_request").inc()
            return JSONResponse(error_body(400, str(exc)), 400)
        up = {k: v for k, v in body.items()
              if k not in ("messages", "max_completion_tokens", "logprobs", "top_logprobs")}
        if body.get("max_completion_tokens") is not None:
            up["max_tokens"] = body["max_completion_tokens"]
        up.update(prompt=ids, return_token_ids=True)
        reply: Reply | None = await run(request, front.complete(
            up, route="chat", path="/v1/completions", session=session))
        return self._respond(reply, False, chat=True, model=front.model)

    def _respond(self, reply: Reply | None, want_ids: bool, *, chat: bool, model: str
                 ) -> Response:
        if reply is None:
            return Response(status_code=499)
        if isinstance(reply, JsonReply):
            if reply.status != 200:
                return JSONResponse(reply.body, status_code=reply.status)
            return JSONResponse(self._fill(reply.body, want_ids, chat))
        assert isinstance(reply, StreamReply)
        return StreamedReply(reply, self._stream(reply.chunks, want_ids, chat, model))

    def _fill(self, answer: dict[str, Any], want_ids: bool, chat: bool) -> dict[str, Any]:
        choices = []
        for c in answer.get("choices", []):
            text = self.decode(c.get("token_ids") or [])
            if chat:
                choices.append({"index": c.get("index", 0), "logprobs": None,
                                "finish_reason": c.get("finish_reason"),
                                "message": {"role": "assistant", "content": text}})
                continue
            c = {**c, "text": text}
            if not want_ids:
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
            choices.append(c)
        if chat:
            return {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
                    "created": int(time.time()), "model": answer.get("model"),
                    "choices": choices, "usage": answer.get("usage")}
        return {**answer, "choices": choices}

    async def _stream(self, chunks: AsyncIterator[bytes], want_ids: bool, chat: bool,
                      model: str) -> AsyncIterator[bytes]:
        """Rewrites each SSE event as it arrives: decoded text in, ids out if unasked.
        The text of a choice's event is the decoding of every id of that choice so far
        minus what was sent. An event without choices (the usage chunk) or that is not
        an answer (an error) passes in the route's shape, or as it is."""
        buf = b""
        ids: dict[int, list[int]] = {}
        sent: dict[int, str] = {}
        cid = "chatcmpl-" + uuid.uuid4().hex
        async for chunk in chunks:
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                line = event.strip()
                if not line.startswith(b"data: {"):
                    yield event + b"\n\n"
                    continue
                ev = json.loads(line[6:])
                if not isinstance(ev.get("choices"), list):
                    yield event + b"\n\n"
                    continue
                out_choices = []
                for c in ev["choices"]:
                    i = int(c.get("index", 0))
                    first = i not in ids
                    ids.setdefault(i, []).extend(c.get("token_ids") or [])
                    text = self.decode(ids[i])
                    delta, sent[i] = text[len(sent.get(i, "")):], text
                    if chat:
                        d: dict[str, Any] = {"content": delta}
                        if first:
                            d = {"role": "assistant", **d}
                        out_choices.append({"index": i, "delta": d, "logprobs": None,
                                            "finish_reason": c.get("finish_reason")})
                        continue
                    c["text"] = delta
                    if not want_ids:
                        c.pop("token_ids", None)
                        c.pop("prompt_token_ids", None)
                    out_choices.append(c)
                if chat:
                    out = {"id": cid, "object": "chat.completion.chunk",
                           "created": ev.get("created"), "model": model,
                           "choices": out_choices}
                    if ev.get("usage") is not None:
                        out["usage"] = ev["usage"]
                else:
                    out = {**ev, "choices": out_choices}
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
        if buf.strip():
            yield buf
