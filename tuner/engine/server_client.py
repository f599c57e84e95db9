"""Talking to a running llama-server over HTTP: health, tokenize, completions (plain and streamed, timed).

The process behind it (start, log, stop) is :mod:`tuner.engine.runner`'s; this module only speaks the protocol.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuner.core.errors import ProcessFailedError, ProcessTimeoutError, RequestRejectedError, ServerGoneError


@dataclass(frozen=True, slots=True)
class StreamedCompletion:
    """One streamed /completion: client-side times and the server's own ``timings`` record."""

    ttft_s: float  # request sent → first generated token received
    elapsed_s: float  # request sent → last byte received
    timings: dict[str, Any]
    tokens_predicted: int
    started_s: float = 0.0  # time.monotonic() when the request was sent
    text: str = ""  # what was generated (a chat client sends it back as the assistant's message)


_NET_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError, json.JSONDecodeError)


class ServerClient:
    """The HTTP side of a llama-server. Subclasses say where it listens and whether its process still runs."""

    host: str
    port: int
    argv: list[str]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def exit_code(self) -> int | None:
        """None while the server process runs."""
        raise NotImplementedError

    def wait_exit(self, timeout_s: float) -> None:
        raise NotImplementedError

    def log_tail(self) -> str:
        raise NotImplementedError

    def gone_error(self) -> ServerGoneError:
        return ServerGoneError("llama-server", self.argv, self.exit_code(), self.log_tail(),
                               "it stopped during the trial; see the log tail")

    def request(self, path: str, payload: dict[str, Any] | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        method = "GET" if data is None else "POST"
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}, method=method
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body: dict[str, Any] = json.loads(resp.read().decode())
            return body

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                raise ProcessFailedError(
                    "llama-server", self.argv, self.exit_code(), self.log_tail(),
                    "check the model file and flags in the log above",
                )
            try:
                if self.request("/health", timeout_s=2.0).get("status") == "ok":
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(0.1)
        raise ProcessTimeoutError(
            "llama-server", self.argv, None, self.log_tail(),
            f"it was not healthy within {timeout_s:.0f} s; a large model may need a longer --load-timeout",
        )

    def complete(self, prompt: str | list[int], n_predict: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """One /completion request; random-weight models stop anywhere, so EOS is ignored."""
        return self.request(
            "/completion",
            {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False},
            timeout_s=timeout_s,
        )

    def tokenize(self, text: str) -> list[int]:
        try:
            body = self.request("/tokenize", {"content": text, "add_special": False})
        except _NET_ERRORS as exc:
            raise self._request_failed(exc) from None
        return [int(t) for t in body["tokens"]]

    def _request_failed(self, exc: BaseException) -> ProcessFailedError:
        self.wait_exit(2.0)  # a dying server closes sockets before it is reaped
        if self.exit_code() is not None:
            return self.gone_error()
        return ProcessFailedError("llama-server", self.argv, None, self.log_tail(),
                                  f"a request failed ({exc}); see the log tail")

    def stream_complete(self, prompt: str | list[int], n_predict: int, timeout_s: float = 300.0) -> StreamedCompletion:
        """A streamed /completion, timing the first token as the client sees it."""
        payload = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False,
                   "stream": True}
        return self._stream("/completion", payload, lambda event: bool(event.get("tokens")), timeout_s)

    def stream_chat(self, messages: list[dict[str, Any]], max_tokens: int, *, timeout_s: float = 300.0,
                    tools: list[dict[str, Any]] | None = None) -> StreamedCompletion:
        """A streamed /v1/chat/completions with the prompt cache on, as an agent sends it.

        The chat endpoint applies the model's template and marks where each message starts, so the server
        can place context checkpoints at user messages (``server-context.cpp``: ``message_spans``,
        ``create_checkpoint``). Its final chunk carries ``timings``: ``cache_n`` prompt tokens taken from the
        slot's cache, ``prompt_n`` processed (``server-common.cpp``: ``result_timings::to_json``).
        """
        payload: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
                                   "cache_prompt": True, "stream": True}
        if tools:
            payload["tools"] = tools
        return self._stream("/v1/chat/completions", payload, _chat_has_token, timeout_s)

    def _stream(self, path: str, payload: dict[str, Any], is_token: Callable[[dict[str, Any]], bool],
                timeout_s: float) -> StreamedCompletion:
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        start = time.monotonic()
        ttft_s: float | None = None
        final: dict[str, Any] = {}
        text: list[str] = []
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                for raw in resp:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if ttft_s is None and is_token(event):
                        ttft_s = time.monotonic() - start
                    text.append(_event_text(event))
                    if event.get("stop") or "timings" in event:
                        final = event
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:300]
            raise RequestRejectedError("llama-server", self.argv, None, f"HTTP {exc.code}: {body}",
                                       "the server refused the request; fit -p/-n into the per-slot context") from None
        except _NET_ERRORS as exc:
            raise self._request_failed(exc) from None
        elapsed = time.monotonic() - start
        if "timings" not in final:
            raise ProcessFailedError("llama-server", self.argv, self.exit_code(), self.log_tail(),
                                     "the stream ended without timings; see the log tail")
        predicted = int(final.get("tokens_predicted", final["timings"].get("predicted_n", 0)))
        return StreamedCompletion(ttft_s if ttft_s is not None else elapsed, elapsed, dict(final["timings"]),
                                  predicted, start, "".join(text))


def _chat_deltas(event: dict[str, Any]) -> list[dict[str, Any]]:
    return [c.get("delta") or {} for c in event.get("choices") or []]


def _chat_has_token(event: dict[str, Any]) -> bool:
    return any(d.get("content") or d.get("reasoning_content") or d.get("tool_calls") for d in _chat_deltas(event))


def _event_text(event: dict[str, Any]) -> str:
    """The generated text one stream event carries (/completion's ``content`` or a chat delta's)."""
    if "choices" not in event:
        return str(event.get("content") or "")
    return "".join(str(d.get("content") or "") for d in _chat_deltas(event))
