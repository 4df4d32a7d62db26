"""The CPU sampler backend: the subset of vLLM's OpenAI server the RL loop uses, over the tiny JAX policy.

Endpoints (same paths, bodies and response shapes as vLLM):
- `GET /health`, `GET /v1/models` (the base model and every loaded adapter, `parent` = base);
- `POST /v1/completions`: `prompt` as token ids, text, or a list of either; `n`, `max_tokens`,
  `temperature`, `seed` (a request without one takes the next of the server's own seeds, `--seed` then
  +1 per request, as vLLM's server-wide seed; the RL loop sends none, since vLLM's TPU backend refuses
  per-request seeds), `stop_token_ids` (a sequence ends after its first stop token, finish_reason
  "stop"), `top_k` then `top_p` (after the temperature, as vLLM's TPU backend applies them), `stop`
  strings (byte vocabulary only: the completion ends with the token that completes the first string, the
  text before it, finish_reason "stop" and stop_reason the string, as vLLM's detokenizer), `logprobs`
  (log-probs of the sampled tokens, raw logits as vLLM's default), `return_token_ids` (each choice
  then carries `token_ids` and `prompt_token_ids`, as vLLM >= 0.10.2);
  `model` selects the adapter by name (or the base model). The tokenizer is UTF-8 bytes (token id = byte
  value), which the tiny model's 256-token vocabulary holds exactly; completion text is the bytes
  decoded (invalid sequences replaced);
- `POST /v1/load_lora_adapter {lora_name, lora_path}`, `POST /v1/unload_lora_adapter {lora_name}`
  (PEFT directories);
- `GET /rljob/v1/adapter`: the adapter version the watcher serves (also `adapter_version` in every
  completion response).

With ``token`` (the run's, rljob.common.credentials) every `/v1` request must carry `Authorization: Bearer
<token>` and is answered 401 without it, as vLLM's server started with `--api-key` (or `VLLM_API_KEY`)
checks the paths under `/v1` and leaves `/health` open (https://docs.vllm.ai/en/stable/usage/security/).

The model is the trainer's tiny MaxText policy (rljob.trainer.model via rljob.trainer.tinypolicy),
built from the same keys and seed, so the two
processes share base weights and the step-0 parity gate can compare their log-probs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from rljob.common.credentials import authorized
from rljob.sampler.adapters import version_of
from rljob.trainer.model import Policy
from rljob.trainer.tinypolicy import Sampler, load_peft_dir

LoraState = Any


class ByteTokenizer:
    """The CPU backend's tokenizer: token id = UTF-8 byte (needs a vocabulary of at least 256)."""

    def __init__(self, vocab_size: int) -> None:
        self.usable = vocab_size >= 256

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def stop_string(
    decode: Callable[[list[int]], str], ids: list[int], stop: list[str]
) -> tuple[int, str, str] | None:
    """Where the first stop string ends a completion, as vLLM's detokenizer stops: (tokens kept, up to
    and with the token that completes the string; the text before the string; the string), or None."""
    if not stop:
        return None
    for end in range(1, len(ids) + 1):
        text = decode(ids[:end])
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            at, s = min(found)
            return end, text[:at], s
    return None


def _bad_request(message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400
    )


class CpuSampler:
    """Adapters by name over one Policy; generation runs in a worker thread, one batch at a time."""

    def __init__(
        self,
        policy: Policy,
        max_loras: int,
        status: Callable[[], dict[str, Any]] | None = None,
        seed: int = 0,
        token: str | None = None,
    ) -> None:
        self.token = token
        self.next_seed = seed
        self.policy = policy
        self.sampler = Sampler(policy)
        self.tokenizer = ByteTokenizer(policy.vocab_size)
        self.base_name = policy.spec.base_model
        self.max_loras = max_loras
        self.adapters: dict[str, tuple[LoraState, str]] = {}
        self.lock = asyncio.Lock()
        self.status = status

    # ------------------------------------------------------------------ handlers
    async def health(self, _req: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _req: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {
                "id": self.base_name,
                "object": "model",
                "created": now,
                "owned_by": "rljob",
                "root": self.base_name,
                "parent": None,
            }
        ]
        data += [
            {
                "id": n,
                "object": "model",
                "created": now,
                "owned_by": "rljob",
                "root": p,
                "parent": self.base_name,
            }
            for n, (_, p) in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def load(self, req: web.Request) -> web.Response:
        body = await req.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return web.Response(status=400, text="lora_name and lora_path are required")
        if name in self.adapters:
            return web.Response(status=400, text=f"The lora adapter '{name}' has already been loaded.")
        if len(self.adapters) >= self.max_loras:
            return web.Response(status=400, text=f"max_loras={self.max_loras} adapters are loaded already")
        try:
            state = await asyncio.to_thread(load_peft_dir, self.policy, Path(path))
        except (OSError, ValueError, KeyError) as e:
            return web.Response(status=400, text=f"cannot load LoRA adapter {name} from {path}: {e}")
        self.adapters[name] = (state, str(path))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, req: web.Request) -> web.Response:
        body = await req.json()
        name = body.get("lora_name")
        if name not in self.adapters:
            return web.Response(status=404, text=f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def adapter_status(self, _req: web.Request) -> web.Response:
        return web.json_response(self.status() if self.status else {"version": None})

    async def completions(self, req: web.Request) -> web.Response:
        body = await req.json()
        model = body.get("model") or self.base_name
        if model == self.base_name:
            lora = self.policy.lora0
        elif model in self.adapters:
            lora = self.adapters[model][0]
        else:
            return web.json_response(
                {
                    "error": {
                        "message": f"The model `{model}` does not exist.",
                        "type": "NotFoundError",
                        "code": 404,
                    }
                },
                status=404,
            )
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
        )
        items = [prompt] if single else prompt
        if not isinstance(items, list) or not items:
            return _bad_request("prompt: a string, a list of token ids, or a non-empty list of either")
        prompts: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                if not self.tokenizer.usable:
                    return _bad_request(
                        f"prompt: text needs a vocabulary of 256 byte tokens; this model has "
                        f"{self.policy.vocab_size}: send token ids"
                    )
                prompts.append(self.tokenizer.encode(item))
            elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
                prompts.append(item)
            else:
                return _bad_request("prompt: a string, a list of token ids, or a non-empty list of either")
        top_p, top_k = float(body.get("top_p", 1.0)), int(body.get("top_k", 0))
        if not 0 < top_p <= 1 or top_k < -1:
            return _bad_request("top_p: in (0, 1]; top_k: -1 or 0 (off) or a number of tokens")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            return _bad_request("stop: a string or a list of non-empty strings")
        if stop and not self.tokenizer.usable:
            return _bad_request(
                f"stop: stop strings need a vocabulary of 256 byte tokens; this model has "
                f"{self.policy.vocab_size}: use stop_token_ids"
            )
        stop_ids = {int(t) for t in body.get("stop_token_ids") or []}
        n = int(body.get("n", 1))
        max_tokens = int(body.get("max_tokens", 16))
        temperature = float(body.get("temperature", 1.0))
        if body.get("seed") is not None:
            seed = int(body["seed"])
        else:
            seed, self.next_seed = self.next_seed, self.next_seed + 1
        want_lp = body.get("logprobs") is not None
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        async with self.lock:
            toks, lps = await asyncio.to_thread(
                partial(self.sampler.generate, top_k=max(top_k, 0), top_p=top_p),
                lora,
                rows,
                max_tokens,
                temperature,
                seed,
            )
        choices = []
        for i in range(len(rows)):
            ids = [int(t) for t in toks[i]]
            row_lps = [float(x) for x in lps[i]]
            finish, stop_reason = "length", None
            cut = next((k for k, t in enumerate(ids) if t in stop_ids), None)
            if cut is not None:  # as vLLM's stop_token_ids: the stop token ends (and is in) the output
                ids, row_lps, finish = ids[: cut + 1], row_lps[: cut + 1], "stop"
            text = self.tokenizer.decode(ids)
            hit = stop_string(self.tokenizer.decode, ids, stop)
            if hit is not None:
                end, text, stop_reason = hit
                ids, row_lps, finish = ids[:end], row_lps[:end], "stop"
            choice: dict[str, Any] = {
                "index": i,
                "text": text,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": ids if body.get("return_token_ids") else None,
                "prompt_token_ids": rows[i] if body.get("return_token_ids") else None,
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in ids],
                    "token_logprobs": row_lps,
                    "text_offset": [],
                    "top_logprobs": [],
                }
                if want_lp
                else None,
            }
            choices.append(choice)
        return web.json_response(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "adapter_version": version_of(model),
                "choices": choices,
                "usage": {
                    "prompt_tokens": sum(map(len, rows)),
                    "completion_tokens": len(rows) * max_tokens,
                    "total_tokens": sum(map(len, rows)) + len(rows) * max_tokens,
                },
            }
        )

    def app(self) -> web.Application:
        token = self.token

        @web.middleware
        async def api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if (
                token is not None
                and request.path.startswith("/v1")
                and not authorized(request.headers.get("Authorization"), token)
            ):
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[api_key])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_get("/rljob/v1/adapter", self.adapter_status)
        return app


__all__ = ["CpuSampler"]
