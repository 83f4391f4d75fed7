"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` and ``tool_choice``, and the tool
calls read back out of what the model wrote.

The tools go to the model's chat template (``tools=``), which describes them to the model in its own
format. What the model answers depends on ``tool_choice``:

* ``"none"``: plain text; nothing is parsed.
* ``"auto"`` (the default with tools): the model may call tools in its template's format, which the
  router's tool-call parser (``router/tool_parsers.py``, ``--tool-call-parser``) reads back. Calls in the
  layout the template teaches are read as they are written, their arguments streamed (``router/call_readers.py``);
  the parser reads the rest of an answer whose call is laid out otherwise, its calls whole. Text that is not a
  well-formed call stays content; a call's arguments end where its text leaves the format (they may then not be
  JSON, as OpenAI's calls of functions that are not strict may not be). Where a function is marked ``strict`` (OpenAI's: its
  calls' arguments hold to its schema), a structural tag holds each call the model writes in that format
  to an offered function and a strict one's arguments to its schema, the text around free (every format with a
  ``call_tag``; the others refused by name). In Llama 3's JSON format, whose calls are the whole answer, the answer
  is either calls or text that opens as no call does (not with ``{``).
* ``"required"``: the answer opens with one or more calls (one when ``parallel_tool_calls`` is false), each
  of a given tool with arguments valid against its ``parameters`` schema.
* a named function: the answer is one call of that function, its arguments valid against its schema.

Where the parser's format has a structural tag (``call_tag``, its special tags held as tokens;
``ToolPlan.in_format``), the calls of those three are held in that format, the one the chat template teaches;
the calls are read in the tag's layout (``router/call_readers.py``), their arguments streamed as they are written
(gpt-oss's harmony format is ``router/harmony.py``'s). Otherwise a ``"required"`` answer is held by a grammar to a JSON array of
``{"name": ..., "arguments": ...}`` calls (``RequiredCalls``), and a named one to the function's arguments,
which become the one call; no parser is needed for either, and each call's arguments stream as written.

Requests the router cannot serve exactly get a 400 that names why: tools on a model whose chat
template does not render them (the model would never see them), or ``"auto"`` without a parser for
the template's format. ``finish_reason`` is ``"tool_calls"`` when an ``"auto"`` or ``"required"``
answer called tools and ended on its own (a named function's answer ends with ``"stop"``, as
OpenAI's does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from common.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutput
from router.call_readers import (
    ArgumentsPiece,
    CallsReader,
    CallStart,
    PieceEvent,
    RequiredCalls,
    calls_reader,
    read_pieces,
)
from router.errors import bad_request
from router.openai_responses import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallOut
from router.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolCallParser,
    ToolCallStream,
    calls_array_schema,
    openai_call_id,
)

if TYPE_CHECKING:
    from router.state import RouterState
    from router.tokenization import PromptProcessor

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")


def _check_function(index: int, tool: Any) -> dict[str, Any]:
    """One entry of ``tools`` as the chat template gets it; a 400 naming what is wrong."""
    param = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request("each tool must be an object with type 'function'", param=param)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request("a tool's function must be an object", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise bad_request(
            "a function's name must be 1 to 64 letters, digits, underscores or dashes", param=f"{param}.function.name"
        )
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise bad_request("a function's description must be a string", param=f"{param}.function.description")
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(
                "a function's parameters must be a JSON schema object", param=f"{param}.function.parameters"
            )
        out["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("a function's strict must be a boolean", param=f"{param}.function.strict")
    return {"type": "function", "function": out}


def _tools_spec(grammar: dict[str, Any]) -> str:
    """A grammar the tools make, as its JSON text; a 400 where it is too long to send."""
    spec = json.dumps(grammar, ensure_ascii=False)
    if len(spec) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise bad_request(
            f"the tools' schemas make a grammar longer than {MAX_STRUCTURED_OUTPUT_CHARS} characters", param="tools"
        )
    return spec


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools (as the template gets them) and how the answer may use them."""

    tools: list[dict[str, Any]]
    choice: str  # "none", "auto", "required" or "named"
    function: str | None = None  # the named function
    parallel: bool = True
    # The functions marked ``strict`` (OpenAI's: their calls' arguments hold to their schema).
    strict: frozenset[str] = frozenset()
    # A structural tag holds the calls in the chat template's own format (``in_format``, ``native_output``).
    native: bool = False
    special: frozenset[str] = frozenset()  # the format's tags the tokenizer makes special tokens (``in_format``)
    # OpenAI's ``allowed_tools``: the functions the answer may call (None: any); the template still gets them all.
    allowed: frozenset[str] | None = None

    @property
    def max_calls(self) -> int | None:
        return 1 if self.choice == "named" or not self.parallel else None

    @classmethod
    def from_request(cls, tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
        """The plan, or None for a request without tools; a 400 naming the field that is malformed."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):  # "auto" with nothing to call: a plain answer
                raise bad_request("tool_choice needs tools", param="tool_choice")
            return None
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"tools holds at most {MAX_TOOLS} functions, got {len(tools)}", param="tools")
        checked = [_check_function(i, tool) for i, tool in enumerate(tools)]
        names = [tool["function"]["name"] for tool in checked]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise bad_request(f"two tools are named {name!r}", param=f"tools.{i}.function.name")
        parallel = parallel_tool_calls is not False
        strict = frozenset(name for name, tool in zip(names, tools, strict=True) if tool["function"].get("strict") is True)
        if tool_choice is None or isinstance(tool_choice, str):
            choice = tool_choice or "auto"
            if choice not in _CHOICES:
                raise bad_request(
                    f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                    param="tool_choice",
                )
            return cls(checked, choice, parallel=parallel, strict=strict)
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
            mode, allowed = _allowed_tools(tool_choice.get("allowed_tools"), names)
            return cls(checked, mode, parallel=parallel, strict=strict, allowed=allowed)
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(
                "tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'function': {'name': ...}} or "
                "{'type': 'allowed_tools', 'allowed_tools': {'mode': ..., 'tools': [...]}}",
                param="tool_choice",
            )
        name = function.get("name")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice.function.name")
        return cls(checked, "named", function=name, parallel=parallel, strict=strict)

    @property
    def functions(self) -> list[dict[str, Any]]:
        """The tools' functions, as the chat template gets them."""
        return [tool["function"] for tool in self.tools]

    @property
    def callable_functions(self) -> list[dict[str, Any]]:
        """The functions the answer may call: the named one, the ``allowed_tools``, or all."""
        return [f for f in self.functions if self.function in (None, f["name"])
                and (self.allowed is None or f["name"] in self.allowed)]

    @property
    def parsed(self) -> bool:
        """Whether the answer is read for tool calls."""
        return self.choice != "none"

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of a ``"required"`` or named answer; None for the others."""
        functions = {function["name"]: function for function in self.functions}
        if self.choice == "named":
            assert self.function is not None
            parameters = functions[self.function].get("parameters")
            if not parameters:
                return StructuredOutput(kind="json_object")
            schema: dict[str, Any] = parameters
        elif self.choice == "required":
            schema = calls_array_schema(self.callable_functions, frozenset(functions), self.parallel)
        else:
            return None
        return StructuredOutput(kind="json_schema", spec=_tools_spec(schema))

    def in_format(self, state: RouterState) -> ToolPlan:
        """The plan with ``native`` set where a structural tag is to hold the calls in the format the chat template
        teaches (the parser's ``call_tag``): ``"auto"`` with strict functions or ``allowed_tools``, and ``"required"``
        and named answers where the format has a tag (else their JSON grammar, ``structured_output``). A 400 for
        those under ``"auto"`` where the format has none."""
        parser = state.tool_parser
        special = state.tags_lost_in_text.intersection(parser.tags) if parser is not None else frozenset()
        if self.choice not in ("auto", "required", "named") or (
                self.choice == "auto" and not self.strict and self.allowed is None):
            return replace(self, special=special)  # (how freely written calls are laid out may depend on them)
        if parser is not None and parser.holds_calls:
            return replace(self, native=True, special=special)
        if self.choice == "auto":
            assert parser is not None, "tools_for_template refuses 'auto' without a parser"
            raise bad_request(
                "strict functions or allowed_tools with tool_choice 'auto' are implemented for the tool-call formats "
                "with a structural "
                f"tag ({', '.join(n for n, p in PARSERS.items() if p.holds_calls)}), not the {parser.name} one here: "
                "drop strict, or ask for tool_choice 'required' or a named function",
                param="tools",
            )
        return self

    def native_output(self, state: RouterState) -> StructuredOutput:
        """The structural tag of a ``native`` plan: every offered function (the named one alone), the arguments of
        the strict ones (of all, for ``"required"`` and named answers) held to their schemas; ``"required"`` and
        named answers open with a call, a named one's is its only one."""
        parser = state.tool_parser
        assert self.native and parser is not None
        functions = self.callable_functions
        forced = self.choice != "auto"
        held = frozenset(f["name"] for f in functions) if forced else self.strict
        tag = parser.call_tag(functions, held, self.parallel and self.choice != "named", forced, self.special)
        assert tag is not None, "in_format checked the format has a tag"
        return StructuredOutput(kind="structural_tag", spec=_tools_spec(tag))

    def pieces_reader(self, parser: ToolCallParser | None) -> CallsReader | None:
        """The reader of an answer's calls that reads their arguments as they are written: calls in the format's
        layout (``calls_reader``), held by its tag or written freely under ``"auto"``; a ``"required"`` answer's JSON
        array. None where the parser reads the calls whole (the pythonic ones) or
        a named answer's text is the call's arguments."""
        if self.native or self.choice == "auto":  # (no parser: gpt-oss's, whose answers harmony reads)
            return calls_reader(parser, self.functions, self.max_calls, self.special, self.native) if parser else None
        if self.choice == "required":
            return RequiredCalls(self.max_calls)
        return None

    @property
    def parser_reads(self) -> bool:
        """Whether the parser reads the answer's calls (``"auto"``, and calls a tag held in a format it reads whole)."""
        return self.choice == "auto" or self.native

    def extract(self, text: str, parser: ToolCallParser | None) -> tuple[str | None, list[ToolCall]]:
        """A whole answer's content and tool calls."""
        reader = self.pieces_reader(parser)
        if reader is not None:
            return read_pieces(reader, text)
        if self.parser_reads:
            assert parser is not None
            content, calls = parser.extract(text, self.functions)
            return content, calls[: self.max_calls]
        if self.choice == "named":
            assert self.function is not None
            return None, [ToolCall(self.function, text)]
        return text, []

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and finish_reason == "stop" and self.choice in ("auto", "required") else finish_reason


def _allowed_tools(spec: Any, names: list[str]) -> tuple[str, frozenset[str]]:
    """OpenAI's ``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}``: its mode
    (``"auto"`` or ``"required"``) and the functions it allows (each one of ``tools``)."""
    param = "tool_choice.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
        raise bad_request("allowed_tools must be {'mode': 'auto' or 'required', 'tools': [...]}", param=f"{param}.mode")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise bad_request("allowed_tools.tools must list one or more of the request's tools", param=f"{param}.tools")
    allowed = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise bad_request(f"allowed_tools.tools.{i} must be {{'type': 'function', 'function': {{'name': ...}}}} "
                              "naming one of the request's tools", param=f"{param}.tools.{i}")
        allowed.append(name)
    return spec["mode"], frozenset(allowed)


def require_rendered(prompts: PromptProcessor) -> None:
    """A 400 when the chat template would not show the model the tools it is given."""
    if not prompts.renders_tools:
        raise bad_request(
            "this model's chat template does not show the model its tools; start the router with a "
            "--chat-template that does (chatml-tools, shipped, for ChatML models)",
            param="tools",
        )


def tools_for_template(state: RouterState, tools: ToolPlan | None) -> list[dict[str, Any]] | None:
    """The tools the chat template gets; a 400 when the answer is to use them but the model would
    not see them, or could call them in a format no parser reads."""
    if tools is None:
        return None
    if tools.parsed:
        require_rendered(state.prompts)
    if tools.choice == "auto" and state.tool_parser is None and not state.harmony:
        raise bad_request(
            "tool_choice 'auto' needs a parser for the chat template's tool-call format, and none is set; "
            f"start the router with --tool-call-parser ({', '.join(PARSERS)}), or ask for tool_choice "
            "'required' or a named function",
            param="tool_choice",
        )
    return tools.tools if state.prompts.renders_tools else None


def new_call_id(parser: ToolCallParser | None, name: str, index: int) -> str:
    """The ``index``-th call's id: of the kind the parser's format takes back, else OpenAI's kind."""
    return parser.new_call_id(name, index) if parser is not None else openai_call_id()


def tool_calls_out(calls: list[ToolCall], parser: ToolCallParser | None) -> list[ToolCallOut]:
    """The calls as the response gives them, each with the id the model wrote or a new one."""
    return [ToolCallOut(id=c.id or new_call_id(parser, c.name, i), function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)]



@dataclass
class ToolDeltas:
    """One streamed choice's text turned into content and tool-call deltas, as it comes.

    Calls in a format's layout (``ToolPlan.pieces_reader``: held by its tag or written freely under ``"auto"``), a
    ``"required"`` answer's, and a named function's arguments stream as they are written, the first delta of a call
    carrying its id and name. Where the parser reads the calls (the pythonic ones),
    content goes out as soon as it cannot be part of a call, and each call whole once it closes."""

    plan: ToolPlan
    parser: ToolCallParser | None
    stream: ToolCallStream | None
    pieces: CallsReader | None = None
    num_calls: int = 0

    @classmethod
    def start(cls, plan: ToolPlan, parser: ToolCallParser | None) -> ToolDeltas:
        reader = plan.pieces_reader(parser)
        if reader is not None:
            return cls(plan, parser, None, reader)
        return cls(plan, parser, parser.stream(plan.functions) if plan.parser_reads and parser is not None else None)

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        if self.stream is not None:
            return self._events(self.stream.feed(text))
        if self.pieces is not None:
            return self.pieces_out(self.pieces.feed(text))
        if self.plan.choice == "named":
            return "", self._named(text) if text else []
        return text, []

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        if self.stream is not None:
            return self._events(self.stream.finish())
        if self.pieces is not None:
            return self.pieces_out(self.pieces.finish())
        if self.plan.choice == "named":  # an empty answer is still the call, as in a whole response
            return "", self._named("") if self.num_calls == 0 else []
        return "", []

    def _open(self, name: str, arguments: str, call_id: str | None = None) -> DeltaToolCall:
        """A call's first delta: its id (the model's, else a new one) and name."""
        function = DeltaFunctionCall(name=name, arguments=arguments)
        call_id = call_id or new_call_id(self.parser, name, self.num_calls)
        call = DeltaToolCall(index=self.num_calls, id=call_id, type="function", function=function)
        self.num_calls += 1
        return call

    def _more(self, arguments: str) -> DeltaToolCall:
        """More of the last call's arguments."""
        return DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=arguments))

    def _named(self, arguments: str) -> list[DeltaToolCall]:
        """A piece of the named call's arguments; the first piece opens the call."""
        if self.num_calls:
            return [self._more(arguments)]
        assert self.plan.function is not None
        return [self._open(self.plan.function, arguments)]

    def pieces_out(self, events: list[PieceEvent]) -> tuple[str, list[DeltaToolCall]]:
        """Content and call deltas of a grammar-held or harmony answer's events."""
        content = ""
        calls: list[DeltaToolCall] = []
        for event in events:
            if isinstance(event, CallStart):
                calls.append(self._open(event.name, "", event.call_id))
            elif isinstance(event, ArgumentsPiece):
                calls.append(self._more(event.text))
            else:
                content += event
        return content, calls

    def _events(self, events: list[str | ToolCall]) -> tuple[str, list[DeltaToolCall]]:
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        if self.plan.max_calls is not None:
            calls = calls[: max(0, self.plan.max_calls - self.num_calls)]
        return content, self._deltas(calls)

    def _deltas(self, calls: list[ToolCall]) -> list[DeltaToolCall]:
        return [self._open(call.name, call.arguments, call.id) for call in calls]


def template_tool_calls(index: int, tool_calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates take them: each call's arguments as
    an object (the request carries them as JSON text, as OpenAI's API does)."""
    param = f"messages.{index}.tool_calls"
    if not isinstance(tool_calls, list):
        raise bad_request("tool_calls must be a list", param=param)
    out = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool call must have a function with a name", param=f"{param}.{j}")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise bad_request(
                    "a tool call's arguments must be a JSON object", param=f"{param}.{j}.function.arguments"
                ) from None
        if not isinstance(arguments, dict):
            raise bad_request(
                "a tool call's arguments must be a JSON object", param=f"{param}.{j}.function.arguments"
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out
