"""Wire models of the OpenAI-compatible routes (routes/openai.py), shaped as OpenAI's own.

Requests refuse unknown fields (422) like the native API. OpenAI parameters Whitney does not implement
and that would change the output are declared here, so the route can refuse them with a 400 naming the
parameter whenever they ask for anything but the default (`REFUSED`); none is ever silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from whitney.protocol.sampling import MAX_TOP_LOGPROBS
from whitney.service.api.native.schemas import INT64_LIMIT, Out, TokenId, Wire

# name -> the values that change nothing (anything else is a 400 naming the parameter)
REFUSED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "service_tier": (None, "auto", "default"), "store": (None, False),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
}
Refused = Any  # a declared OpenAI parameter that only its default passes (REFUSED)


class StreamOptions(Wire):
    include_usage: bool | None = None  # a last chunk with the usage and no choices


class TextPart(Wire):
    type: Literal["text"]
    text: str


class ChatMessage(Wire):
    """One turn. `developer` is read as `system` (the models' templates know only the latter)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # handed to the chat template with the message


class Sampling(Wire):
    """What chat and text completions share."""

    model: str = Field(description="a served base model, '<run_id>@<version>', a checkpoint id (pkg-...) or a "
                                   "Tinker path (tinker://<run_id>/sampler_weights/<name>, or .../weights/<name>)")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, description="default 1; 0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    seed: int | None = Field(None, ge=0, lt=INT64_LIMIT)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    metadata: dict[str, str] | None = None  # accepted, unused
    presence_penalty: Refused = None
    frequency_penalty: Refused = None
    logit_bias: Refused = None
    service_tier: Refused = None
    store: Refused = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Refused = None
    tool_choice: Refused = None
    parallel_tool_calls: Refused = None
    functions: Refused = None
    function_call: Refused = None
    response_format: Refused = None
    modalities: Refused = None
    audio: Refused = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    web_search_options: Refused = None


class CompletionRequest(Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the sampled token's and this many others'
    echo: Refused = None
    suffix: Refused = None
    best_of: Refused = None


class ChatRenderRequest(Wire):
    """A conversation to render with a served model's own chat template."""

    model: str | None = None  # default: the server's first model; a run's version, checkpoint or path names its base
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = False


# ---- answers ---------------------------------------------------------------------------------------

class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Out):
    content: list[TokenLogprob] | None


class AssistantMessage(Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(Out):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(Out):
    """The served base models, then the key's newest sampler versions and checkpoints (routes/openai.py LISTED)."""

    object: Literal["list"]
    data: list[ModelCard]


class ChatRendering(Out):
    model: str  # the base model whose template rendered it
    tokens: list[int]
    assistant_mask: list[int]  # 1 on each assistant message's tokens (end-of-turn included), else 0
